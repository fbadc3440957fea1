"""Script-check rules: the learning rate scaled by the device count by hand."""

from __future__ import annotations

import ast

from xlatrain.doctor.script_check.common import (
    _LR_NAME,
    _WORLD_SIZE_CALLS,
    _WORLD_SIZE_NAME,
)


class LrScalingRules:
    """The learning rate scaled by the device count by hand."""

    def check_lr_scaling(self) -> None:
        for node in ast.walk(self.tree):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
                continue
            if not (self.is_world_size(node.left) or self.is_world_size(node.right)):
                continue
            parent = self.parents.get(node)
            context = ""
            if isinstance(parent, ast.keyword):
                context = parent.arg or ""
            elif isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                context = " ".join(self.assigned_names(node)) or ast.unparse(getattr(parent, "target", parent))
            elif isinstance(parent, ast.Dict):
                context = " ".join(ast.unparse(k) for k, v in zip(parent.keys, parent.values) if v is node and k)
            if _LR_NAME.search(context):
                counted = any(isinstance(s, ast.Call) and self.is_world_size(s) for s in (node.left, node.right))
                factor = "the device count" if counted else "what its name says is the device count"
                self.add(
                    node,
                    "manual-lr-scaling",
                    "info",
                    f"the learning rate is multiplied by {factor} by hand ({ast.unparse(node)})",
                    "TrainConfig(scale_lr=True) scales every learning rate by the number of devices "
                    "once, and the run log states the global batch and learning rate",
                )
    def is_world_size(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Call):
            return self.call_name(node).split(".")[-1] in _WORLD_SIZE_CALLS
        if isinstance(node, (ast.Name, ast.Attribute, ast.Subscript)):
            return bool(_WORLD_SIZE_NAME.search(ast.unparse(node)))
        return False
