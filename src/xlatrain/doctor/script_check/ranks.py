"""Script-check rules: a device value read on the main process only.

torch_xla tutorials print and save under ``if xm.is_master_ordinal():``. A host read in that
branch (``loss.item()``, ``t.cpu()``, ``print(t)``) is made by one process while the others go on.
On torch_xla it can run the pending graph on that process alone; on TorchTPU every process must
make the same reads in the same order, or the mesh stops there (measured: DESIGN.md, "TorchTPU
traps"). Which runtime the script will meet is not in the file, so this is a porting note.
"""

from __future__ import annotations

import ast

from xlatrain.doctor.script_check.common import _PRINTS, _SYNC_METHODS, _Port

# Calls true on one process only, and calls of a process's index (one process where compared
# equal to a number).
_MAIN_ONLY = {"torch_xla.core.xla_model.is_master_ordinal", "torch_xla.core.xla_model.is_master"}
_INDEX_CALLS = {
    "torch_xla.runtime.global_ordinal", "torch_xla.runtime.local_ordinal", "torch_xla.runtime.process_index",
    "torch_xla.core.xla_model.get_ordinal", "torch_xla.core.xla_model.get_local_ordinal",
    "torch.distributed.get_rank",
}

_PORT_ONE_PROCESS_READ = _Port(
    "port:read-on-every-process",
    "a device value read on one process only stops the mesh there: every process must make "
    "the same host reads in the same order. Read it on every process (v = t.item()), then print or "
    "save it where torch.distributed.get_rank() == 0",
    "the Trainer makes every host read it plans on every process and prints on the main one",
)


class RankRules:
    """A device value read inside a branch only the main process takes."""

    def main_only(self, test: ast.AST) -> bool:
        """True when ``test`` holds on one process only: is_master_ordinal(), or an ordinal == N."""
        if isinstance(test, ast.Call):
            return (self.qualify(test.func) or "") in _MAIN_ONLY
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            left, right = test.left, test.comparators[0]
            for call, other in ((left, right), (right, left)):
                if (isinstance(call, ast.Call) and (self.qualify(call.func) or "") in _INDEX_CALLS
                        and isinstance(other, ast.Constant) and type(other.value) is int):
                    return True
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return any(self.main_only(v) for v in test.values)
        return False

    def check_reads_on_one_process(self) -> None:
        for branch in (n for n in ast.walk(self.tree) if isinstance(n, ast.If) and self.main_only(n.test)):
            for node in (n for stmt in branch.body for n in ast.walk(stmt)):
                read = self.device_read(node)
                if read is not None:
                    self.add_port(node, f"{read} under `if {ast.unparse(branch.test)}`", _PORT_ONE_PROCESS_READ)

    def device_read(self, node: ast.AST) -> str | None:
        """What ``node`` reads from the device to the host, where the code shows a device value."""
        if not isinstance(node, ast.Call):
            return None
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _SYNC_METHODS and not node.args and self.is_device(func.value):
            return ast.unparse(node)
        name = self.call_name(node)
        if name in ("float", "int", "bool") and node.args and self.is_device(node.args[0]):
            return ast.unparse(node)
        if name in _PRINTS and any(self.printed(a, self.is_device) for a in [*node.args, *(k.value for k in node.keywords)]):
            return f"{ast.unparse(func)}() of a device tensor"
        return None
