"""Script-check rules: modules whose forward takes tensors of changing shape."""

from __future__ import annotations

import ast

from xlatrain.doctor.script_check.common import (
    _SAME_KIND_METHODS,
    _walk,
)


class ClassRules:
    """Modules whose forward takes tensors of changing shape."""

    def constructed_class(self, expr: ast.AST | None, depth: int = 0) -> str | None:
        """The class defined in the file whose instance ``expr`` is, when the code shows it."""
        if expr is None or depth > 6:
            return None
        if isinstance(expr, ast.Call):
            if isinstance(expr.func, ast.Name):
                b = self.resolve(expr.func).single
                if b is not None and b.kind == "def" and isinstance(b.value, ast.ClassDef):
                    return b.value.name
            if isinstance(expr.func, ast.Attribute) and expr.func.attr in ("to", *_SAME_KIND_METHODS):
                return self.constructed_class(expr.func.value, depth + 1)
        if isinstance(expr, ast.Name):
            b = self.resolve(expr).single
            if b is not None and b.kind == "assign" and not b.path:
                return self.constructed_class(b.value, depth + 1)
        return None
    def check_classes(self) -> None:
        moved_classes = {self.constructed_class(m.func.value) for m in self.xla_moves}  # type: ignore[union-attr]
        for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            bases = [self.qualify(b) or "" for b in cls.bases]
            lightning = any(b.split(".")[0] in ("pytorch_lightning", "lightning") or b.endswith("LightningModule") for b in bases)
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "on_post_move_to_device" and lightning:
                    self.add(
                        fn,
                        "removed-api",
                        "info",
                        "LightningModule.on_post_move_to_device was removed in Lightning 1.7: nothing "
                        "calls it any more (Lightning >= 1.5 re-ties shared parameters on TPU itself)",
                        "delete the hook; in a plain torch_xla loop tie the weights after model.to(device)",
                    )
            if lightning or not (self.uses_xla and cls.name in self.module_classes):
                continue
            init = self.method(cls, "__init__")
            for node in _walk(init.body if init else []):
                if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                    continue
                target, value = node.targets[0], node.value
                if not (
                    isinstance(target, ast.Attribute)
                    and isinstance(value, ast.Attribute)
                    and target.attr in ("weight", "bias")
                    and value.attr in ("weight", "bias")
                ):
                    continue
                tail = ast.unparse(target).split(".")[-2:]
                retied = any(
                    isinstance(n, ast.Assign)
                    and n is not node
                    and any(isinstance(t, ast.Attribute) and ast.unparse(t).split(".")[-2:] == tail for t in n.targets)
                    for n in ast.walk(self.tree)
                )
                if retied:
                    continue
                moved = cls.name in moved_classes
                self.add(
                    node,
                    "weight-tying",
                    "error" if moved else "info",
                    f"{ast.unparse(target)} = {ast.unparse(value)} ties weights before the model moves"
                    + ("" if moved else " (if it moves to an XLA device)")
                    + ": on XLA .to(device) copies each module's parameter separately (measured with "
                    "torch_xla 2.9: one tied weight became two parameters), so the tie is lost",
                    "tie the weights again after model.to(device) (a tie_weights() method called "
                    "after the move)",
                )
