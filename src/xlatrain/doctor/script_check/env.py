"""Script-check rules: environment variables a script sets (XLA_USE_BF16 and the other traps the environment doctor knows)."""

from __future__ import annotations

import ast
from xlatrain.doctor.environment import env_trap

from xlatrain.doctor.script_check.common import (
    _BF16_ENV,
    _PORT_BF16,
    _const,
)


class EnvRules:
    """Environment variables a script sets (XLA_USE_BF16 and the other traps the environment doctor knows)."""

    def env_finding(self, node: ast.AST, name: str, value: ast.AST | None) -> None:
        literal = _const(value)
        is_literal = isinstance(value, ast.Constant)
        off = isinstance(literal, str) and literal.strip().lower() in ("", "0", "false", "no", "off")
        if name in _BF16_ENV and not off:
            self.add_port(node, f"{name}=1", _PORT_BF16)
        trap = env_trap(name)
        if trap is None:
            return
        if trap.flag and off:
            return
        if trap.flag and not is_literal:
            self.add(
                node,
                "env-var",
                "info",
                f"sets {name} from a value the check cannot read ({ast.unparse(value) if value is not None else '?'}): "
                f"if it is on, {trap.today}",
                trap.fix,
            )
            return
        self.add(node, "env-var", trap.severity, f"sets {name}: {trap.today}", trap.fix)
    def check_env_assignments(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (
                        isinstance(target, ast.Subscript)
                        and self.qualify(target.value) == "os.environ"
                        and isinstance(_const(target.slice), str)
                    ):
                        name = _const(target.slice)
                        if isinstance(node.value, ast.Constant) and not isinstance(node.value.value, str):
                            self.add(
                                node,
                                "env-var",
                                "error",
                                f"os.environ[{name!r}] = {ast.unparse(node.value)}: os.environ takes str "
                                f"values only (TypeError: str expected, not {type(node.value.value).__name__})",
                                f"os.environ[{name!r}] = {str(node.value.value)!r}, or better leave {name} "
                                "unset and configure xlatrain instead",
                            )
                        else:
                            self.env_finding(node, name, node.value)
    def check_env_call(self, call: ast.Call, name: str) -> None:
        if name in ("os.environ.setdefault", "os.putenv") and call.args and isinstance(_const(call.args[0]), str):
            self.env_finding(call, _const(call.args[0]), call.args[1] if len(call.args) > 1 else None)
        elif name == "os.environ.update":
            for arg in call.args:
                if isinstance(arg, ast.Dict):
                    for k, v in zip(arg.keys, arg.values):
                        if isinstance(_const(k), str):
                            self.env_finding(call, _const(k), v)
            for kw in call.keywords:
                if kw.arg:
                    self.env_finding(call, kw.arg, kw.value)
        elif isinstance(call.func, ast.Attribute) and call.func.attr == "run_line_magic":
            # a notebook exported to .py: get_ipython().run_line_magic('env', 'XLA_USE_BF16=1')
            if len(call.args) == 2 and _const(call.args[0]) == "env" and isinstance(_const(call.args[1]), str):
                var, _, val = _const(call.args[1]).partition("=")
                self.env_finding(call, var.strip(), ast.Constant(val.strip()))
