"""What ``torch.compile`` did during a run: graph breaks, recompilations, recompile-limit hits.

:class:`CompileWatch` reads what ``torch._dynamo`` records about every compilation whatever the
logging settings, so it changes no logging configuration and prints nothing:

- ``torch._dynamo.utils.get_compilation_metrics()``: one ``CompilationMetrics`` per compiled frame:
  its function, file and first line, ``recompile_reason`` (the guard that failed), ``fail_reason``
  when dynamo gave up on the frame (recompile limit, a graph break it cannot resume from), and
  compile seconds. It is a ring of the last 64, so the watch also reads it at the start of every
  compilation, from a callback in ``torch._dynamo.callback_handler`` that runs only while dynamo
  compiles.
- ``torch._dynamo.utils.graph_break_reasons``: one ``GraphCompileReason`` per graph break met while
  compiling: the reason, and the user's stack as ``FrameSummary`` objects (file, line, function).
- ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``: graphs handed to the backend.
- ``torch._dynamo.utils.guard_failures``: every guard failure per code object, one per compiled
  version checked, most recently used first: read to name the function of a recompile-limit hit,
  whose metrics dynamo records before it names the code, and to find why a version for one mode
  (training, evaluation) compiled again when dynamo's record names only the guard that failed on
  the first version it checked, another mode's.

A step that compiles nothing runs no code of this module, so the steady state costs nothing.
``torch._dynamo`` is imported by :meth:`CompileWatch.start`, not at import. Torch 2.9 keeps the same
registries, with two differences: a guard failure names the user's line only in its comment (read
here too), and a function dynamo gives up on (a graph break inside a loop) is recorded as compiled,
without a reason, so there that skip goes unreported.

Example::

    watch = CompileWatch().start()  # before the first compiled call
    try:
        for epoch in range(1, epochs + 1):
            train_one_epoch(compiled_model)
            row = watch.end_epoch(epoch)  # the first epoch is warm-up, unless told otherwise
            if strict and (error := watch.strict_error()):
                raise RuntimeError(error)
    finally:
        watch.stop()
    for finding in watch.findings():
        print(finding.title, finding.evidence, finding.fix, sep="\\n")

Told where a run is (:meth:`CompileWatch.at`: the phase, training or evaluation, and whether its
warm-up steps are under way), as ``RunDiagnostics`` tells it, the watch judges the first epoch
finer: there a clean run compiles each function's first version per phase, and any other
recompilation after the warm-up steps is one after warm-up.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import re
import sysconfig
from dataclasses import dataclass, field
from typing import Any

from xlatrain.diagnostics.run import Finding

MAX_SITES = 8  # graph-break sites and failing guards given a finding each; more are summed up
MAX_EVENTS = 200  # compilations listed in diagnostics.json; more are counted, not listed
MAX_VALUES = 6  # values of one changing Python number or shape listed in a finding

_COMPILE_ID = re.compile(r"^\s*\[?\d+/\d+\]?:\s*")  # "0/1: " before each guard failure
_TENSOR = re.compile(
    r"tensor '(?P<name>.+?)' (?P<what>[\w ]+?) mismatch(?: at index (?P<index>\d+))?"
    r"(?:\. expected (?P<expected>[^,]+?)(?:, actual (?P<actual>[^.\s]+))?)?(?:\.|$)"
)
_EQUALS = re.compile(r"^(?P<expr>.+?)\s*==\s*(?P<value>.+)$")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_HINT = re.compile(r"\(HINT: (?P<hint>.*)\)\s*$")
# The guard's comment: "# <source line>  # <end of the path>:<line> in <function>".
_COMMENT = re.compile(r"#.*#\s*(?P<path>\S+):(?P<line>\d+) in (?P<func>\S+)\s*$")
_LIMIT = re.compile(r"recompile[_ ]limit|cache[_ ]size[_ ]limit", re.IGNORECASE)
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<func>.+)_at_(?P<line>\d+)$")
_ENTRY = re.compile(r"^\s*\[?(?P<frame>\d+)/(?P<version>\d+)\]?:")  # the compiled version a guard failure is of


@dataclass(frozen=True)
class _Site:
    """A line of source code."""

    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{_short(self.file)}:{self.line}"

    def source(self) -> str:
        return linecache.getline(self.file, self.line).strip()


@dataclass(frozen=True)
class _Code:
    """Which source files are the user's: not torch's (or its TPU runtimes'), not the standard
    library's, not xlatrain's own apart from its recipes, which are models like a user's."""

    packages: tuple[str, ...]
    stdlib: str
    recipes: str
    torch: str

    @classmethod
    def here(cls) -> _Code:
        import torch

        def folder(path: str) -> str:
            return os.path.join(os.path.abspath(path), "")

        packages = [os.path.dirname(torch.__file__)]
        for name in ("torch_xla", "torch_tpu", "functorch"):
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            if spec is not None and spec.submodule_search_locations:
                packages.extend(spec.submodule_search_locations)
        xlatrain = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        packages.append(xlatrain)
        return cls(packages=tuple(folder(p) for p in packages), stdlib=folder(sysconfig.get_paths()["stdlib"]),
                   recipes=folder(os.path.join(xlatrain, "recipes")), torch=folder(packages[0]))

    def users(self, file: str) -> bool:
        if file.startswith("<"):  # <string>, <frozen ...>, generated code
            return False
        path = os.path.abspath(file)
        if path.startswith(self.recipes):
            return True
        # Without a virtual environment site-packages lies inside the standard library's folder.
        stdlib = path.startswith(self.stdlib) and not _third_party(path)
        return not (stdlib or path.startswith(self.packages))

    def in_torch(self, file: str) -> bool:
        return os.path.abspath(file).startswith(self.torch)


@dataclass
class _Compile:
    """One frame dynamo compiled (or gave up on)."""

    period: int  # 0 = warm-up (before the first end_epoch), then one per epoch
    compile_id: str
    kind: str  # "compile", "limit" (recompile limit reached) or "skipped" (dynamo gave up)
    function: str
    file: str | None
    line: int | None
    reason: str | None  # the guard failure that made it compile again
    failure: str | None
    fail_at: _Site | None
    seconds: float
    limit: int | None
    expected: bool = False  # the first version for evaluation (no_grad, model.eval()) of a function
    late: bool = False  # after warm-up: a later epoch, or the first one after its warm-up steps
    # For a version of one mode compiled again while dynamo names only another mode's version's
    # mode guard: the guard that failed on another version (that mode's own), which is the cause.
    cause: str | None = None

    @property
    def recompile(self) -> bool:
        return self.kind == "compile" and self.reason is not None

    @property
    def unexpected(self) -> bool:
        return self.recompile and not self.expected


@dataclass
class _Break:
    """One place where graphs break, with every compilation that met it."""

    kind: str
    at: _Site | None
    caller: _Site | None
    inner: _Site | None  # where dynamo stopped, when that is library code called from ``at``
    reason: str
    periods: list[int] = field(default_factory=list)
    late: int = 0  # of those compilations, how many after warm-up


class CompileWatch:
    """Collects torch.compile's evidence during a run and turns it into findings.

    Start it before the first compiled call, call :meth:`end_epoch` after each epoch (the first
    call ends warm-up) and :meth:`stop` at the end of the run, also when the run fails; a training
    loop that calls :meth:`at` whenever its phase or warm-up changes makes the first epoch's warm-up
    its warm-up steps. It adds one callback to ``torch._dynamo.callback_handler`` and removes it on
    ``stop``; it changes no logging and no dynamo config.
    """

    def __init__(self) -> None:
        self._started = False
        self._stopped = False
        self._callback: Any = None
        self._code: _Code | None = None
        self._last_record: Any = None  # the newest CompilationMetrics already read
        self._breaks_read = 0  # entries of graph_break_reasons already read
        self._graphs_before = 0
        self._graphs = 0
        self._period = 0
        self._marks = {"graphs": 0}
        self._epochs: list[int] = []  # epoch number of each period that ended
        self._first_epoch = 1
        self._frames: dict[str, tuple[str, str, int]] = {}  # frame id -> (function, file, first line)
        self._compiles: list[_Compile] = []
        self._modes: set[tuple[Any, ...]] = set()  # (function, file, guard) that compiled for a mode
        self._versions: set[tuple[Any, ...]] = set()  # (function, file, phase) compiled in a phase
        self._phase: str | None = None  # "train" or "eval" while a pass runs, when told (at)
        self._warm = True  # in warm-up: the first epoch, or its warm-up steps once told (at)
        self._warm_s = 0.0  # compile seconds in warm-up, backward graphs included
        self._last_late = False  # whether the last forward graph read compiled after warm-up
        self._failures_read: dict[Any, int] = {}  # code -> guard_failures entries already matched
        self._breaks: dict[tuple[str, str, int], _Break] = {}
        self._seconds: dict[int, float] = {}  # compile seconds per period, backward graphs included
        self._lost = False
        self._reset_seen = False

    # --- collection ----------------------------------------------------------------------------
    def start(self, first_epoch: int = 1) -> CompileWatch:
        """Begin collecting; what dynamo compiled before this call is not counted.

        Args:
            first_epoch: the number of the epoch about to run (later than 1 when a run resumes).
        """
        if self._started:
            return self
        import torch._dynamo
        from torch._dynamo import utils

        self._code = _Code.here()
        self._first_epoch = first_epoch
        records = utils.get_compilation_metrics()
        for record in records:
            self._remember_frame(record)
        self._last_record = records[-1] if records else None
        self._breaks_read = len(utils.graph_break_reasons)
        self._graphs_before = _unique_graphs()

        def on_compile_start(_args: Any) -> None:
            # Runs inside dynamo's compilation: an exception here would fail the user's compile.
            try:
                self._harvest()
            except Exception:  # noqa: BLE001
                self._lost = True

        self._callback = on_compile_start
        torch._dynamo.callback_handler.register_start_callback(on_compile_start)
        self._started = True
        return self

    def stop(self) -> None:
        """Read the last evidence and remove the callback; safe to call again."""
        if not self._started or self._stopped:
            return
        import torch._dynamo

        try:
            self._harvest()
        finally:
            self._stopped = True
            handler = torch._dynamo.callback_handler
            if self._callback in handler.start_callbacks:
                handler.remove_start_callback(self._callback)

    def __enter__(self) -> CompileWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def at(self, phase: str | None, warm_up: bool) -> None:
        """Where the run is now: what compiles from here on is booked to it.

        Without these calls everything before the first :meth:`end_epoch` is warm-up. With them,
        a recompilation in the first epoch outside its warm-up steps is one after warm-up, unless
        it is a function's first version in its phase (evaluation's own version of ``forward``).
        Call it only when something changes: it reads dynamo's records first.

        Args:
            phase: ``"train"`` or ``"eval"`` while a pass runs; None between passes.
            warm_up: whether the run's warm-up steps (its first optimizer steps) are under way.
        """
        if (phase, warm_up) == (self._phase, self._warm):
            return
        self._harvest()  # what compiled so far happened where the run was before
        self._phase, self._warm = phase, warm_up

    def end_epoch(self, epoch: int) -> dict[str, Any]:
        """This epoch's torch.compile numbers; the first call ends warm-up.

        Args:
            epoch: the epoch that just ended (its evaluation included).

        Returns:
            ``compilations`` (frames compiled), ``recompilations``, ``graphs``, ``graph_breaks``
            (met while compiling) and ``compile_s``, for this epoch only.
        """
        self._harvest()
        period = self._period
        compiles = [c for c in self._compiles if c.period == period]
        row = {
            "compilations": sum(1 for c in compiles if c.kind == "compile"),
            "recompilations": sum(1 for c in compiles if c.recompile),
            "graphs": self._graphs - self._marks["graphs"],
            "graph_breaks": sum(b.periods.count(period) for b in self._breaks.values()),
            "compile_s": round(self._seconds.get(period, 0.0), 3),
        }
        self._marks = {"graphs": self._graphs}
        self._epochs.append(epoch)
        self._period += 1
        return row

    def _harvest(self) -> None:
        if not self._started or self._stopped:
            return
        import torch._dynamo
        from torch._dynamo import utils

        # torch._dynamo.reset() drops every callback and clears graph_break_reasons: keep watching.
        if self._callback not in torch._dynamo.callback_handler.start_callbacks:
            self._reset_seen = True
            torch._dynamo.callback_handler.register_start_callback(self._callback)
        graphs = _unique_graphs()
        if graphs < self._graphs_before + self._graphs:  # the counters were cleared
            self._graphs_before = graphs - self._graphs
        self._graphs = graphs - self._graphs_before

        records = utils.get_compilation_metrics()
        new = records
        if self._last_record is not None:
            for i in range(len(records) - 1, -1, -1):
                if records[i] is self._last_record:
                    new = records[i + 1:]
                    break
            else:
                # The ring moved past the last record read (more than its length in between).
                ring = getattr(getattr(utils, "_compilation_metrics", None), "maxlen", None) or 64
                self._lost = self._lost or len(records) >= ring
        for record in new:
            self._read_record(record)
        if new:
            self._last_record = new[-1]

        reasons = utils.graph_break_reasons
        if len(reasons) < self._breaks_read:
            self._reset_seen = True
            self._breaks_read = 0
        # A graph break is recorded while its frame compiles, before the frame's metrics: the
        # frames read above (each compilation's start reads what the last one left) are where
        # these breaks were met.
        met_late = self._last_late if any(getattr(r, "is_forward", True) is not False for r in new) \
            else not self._in_warm_up()
        for reason in reasons[self._breaks_read:]:
            self._read_break(reason, met_late)
        self._breaks_read = len(reasons)

    def _remember_frame(self, record: Any) -> None:
        frame = str(getattr(record, "compile_id", "") or "").split("/")[0]
        name = getattr(record, "co_name", None)
        if frame and name:
            self._frames[frame] = (name, record.co_filename, record.co_firstlineno)

    def _read_record(self, record: Any) -> None:
        if getattr(record, "is_forward", True) is False:
            # The backward graph, compiled at the first backward(): its time only.
            backward_us = getattr(record, "backward_cumulative_compile_time_us", None) or 0
            self._seconds[self._period] = self._seconds.get(self._period, 0.0) + backward_us / 1e6
            self._warm_s += backward_us / 1e6 if self._period == 0 and not self._last_late else 0.0
            return
        seconds = float(getattr(record, "entire_frame_compile_time_s", None) or 0.0)
        self._seconds[self._period] = self._seconds.get(self._period, 0.0) + seconds
        self._remember_frame(record)
        compile_id = str(getattr(record, "compile_id", "") or "")
        reason = getattr(record, "recompile_reason", None)
        failure = getattr(record, "fail_reason", None)
        if failure is not None:
            kind = "limit" if _LIMIT.search(_first_line(failure)) else "skipped"
        elif getattr(record, "has_guarded_code", True) is False:
            self._last_late = not self._in_warm_up()
            self._warm_s += 0.0 if self._last_late else seconds
            return  # a frame with nothing to compile runs as it is: nothing to report
        else:
            kind = "compile"
        # A frame that hit the recompile limit is recorded before dynamo names its code.
        name, file, line = self._frames.get(compile_id.split("/")[0], (None, None, None))
        if name is None and reason:
            name, file, line = _frame_of_guard_failure(reason)
        fail_at = None
        if getattr(record, "fail_user_frame_filename", None):
            fail_at = _Site(record.fail_user_frame_filename, int(record.fail_user_frame_lineno or 0), name or "?")
        # Evaluation (no_grad, model.eval()) compiles its own version of each function the first
        # time it runs, in whichever epoch that is: how a clean run starts, not something to fix.
        # Dynamo names only the first guard that failed on the version it checked first (the most
        # recently used), which for that first evaluation call may be another than the mode's: the
        # phase, where told, says it too.
        expected, cause = False, None
        version = (name, file, self._phase)
        guard = _parse_guard(reason) if reason else None
        if kind == "compile" and guard is not None:
            if guard["kind"] == "mode":
                mode = (name, file, guard["text"])
                expected = mode not in self._modes
                self._modes.add(mode)
            expected = expected or (self._phase is not None and version not in self._versions)
        if guard is not None:
            older = self._older_failures((name, file, line), compile_id, reason)  # each one, in order
            if kind == "compile" and guard["kind"] == "mode" and not expected:
                cause = next((t for t in older if _parse_guard(t)["kind"] not in ("mode", "unknown")), None)
        if kind == "compile" and self._phase is not None:
            self._versions.add(version)
        # In the first epoch, a function's first version (per phase) is warm-up wherever it compiles.
        late = self._period > 0 or not (self._warm or (kind == "compile" and (expected or not reason)))
        self._last_late = late  # the backward graph's record follows its forward's
        self._warm_s += 0.0 if late else seconds
        self._compiles.append(_Compile(
            period=self._period, compile_id=compile_id, kind=kind, function=name or "?", file=file, line=line,
            reason=reason, failure=failure, fail_at=fail_at, seconds=seconds, limit=_recompile_limit(failure),
            expected=expected, late=late, cause=cause,
        ))

    def _in_warm_up(self) -> bool:
        return self._period == 0 and self._warm

    def _older_failures(self, where: tuple[Any, ...], compile_id: str, reason: str) -> list[str]:
        """The guards that failed on the other compiled versions of a recompiled frame, besides the
        one dynamo's record names (``reason``, that of the version it checked first).

        Dynamo appends to ``guard_failures`` one failure per version it checked, most recently used
        first, each led by that version's compile id: this compilation's follow ``reason``, each of
        another version older than this one. Read for every recompilation in turn, so that each
        finds its own.
        """
        from torch._dynamo import utils

        this = re.match(r"\D*(\d+)/(\d+)", compile_id)
        for code, failures in list(utils.guard_failures.items()):
            if (code.co_name, code.co_filename, code.co_firstlineno) != where:
                continue
            start = self._failures_read.get(code, 0)
            if start > len(failures):  # torch._dynamo.reset() cleared them
                start = 0
            for i in range(start, len(failures)):
                if failures[i] != reason:
                    continue
                older: list[str] = []
                first = _ENTRY.match(reason)
                seen = {first["version"]} if first else set()
                for text in failures[i + 1:]:
                    entry = _ENTRY.match(text)
                    if not (entry and first and this and entry["frame"] == first["frame"] == this[1]
                            and entry["version"] not in seen and int(entry["version"]) < int(this[2])):
                        break
                    older.append(text)
                    seen.add(entry["version"])
                self._failures_read[code] = i + 1 + len(older)
                return older
        return []

    def _read_break(self, reason: Any, late: bool) -> None:
        text = str(getattr(reason, "reason", "") or "")
        if text.startswith("DDPOptimizer"):
            return  # DDP splits the graph at its gradient buckets on purpose
        frames = [_Site(f.filename, int(f.lineno or 0), f.name)
                  for f in getattr(reason, "user_stack", None) or [] if getattr(f, "filename", None)]
        at, caller = self._user_site(frames)
        # torch's own polyfills end many stacks: the library frame above them says more.
        called = frames[max((i for i, f in enumerate(frames) if f is at), default=len(frames)) + 1:]
        outside_torch = [f for f in called if not self._code.in_torch(f.file)]
        inner = (outside_torch or called or [None])[-1]
        kind = _break_kind(text)
        key = (kind, at.file if at else "?", at.line if at else 0)
        entry = self._breaks.setdefault(key, _Break(kind=kind, at=at, caller=caller, inner=inner, reason=text))
        entry.periods.append(self._period)
        entry.late += late

    def _user_site(self, sites: list[_Site]) -> tuple[_Site | None, _Site | None]:
        """The innermost frame that is not torch's, the standard library's or xlatrain's (the
        innermost of all when none is); and when that one lies in a third-party package, the
        innermost frame outside site-packages too."""
        mine = [s for s in sites if self._code.users(s.file)]
        if not mine:
            return (sites[-1] if sites else None), None
        at = mine[-1]
        caller = None
        if _third_party(at.file):
            own = [s for s in mine if not _third_party(s.file)]
            caller = own[-1] if own else None
        return at, caller

    # --- findings ------------------------------------------------------------------------------
    def findings(self) -> list[Finding]:
        """Graph breaks (one per site), recompilations (one per guard that kept failing),
        recompile-limit hits and functions dynamo skipped, each with its evidence and a fix."""
        return [f for f, _ in self._judged()]

    def strict_error(self, *, graph_breaks: bool = True) -> str | None:
        """What ``strict`` mode raises on, or None.

        Errors: a recompilation after warm-up, a recompile-limit hit, a function dynamo skipped,
        and with ``graph_breaks=True`` any graph break.
        """
        listed = [f for f, late in self._judged() if late or f.code in ("recompile-limit", "compile-skipped")
                  or (graph_breaks and f.code == "graph-break")]
        if not listed:
            return None
        return "strict (torch.compile): " + "; ".join(f"{f.title} -> {f.fix.rstrip('.')}" for f in listed)

    def _judged(self) -> list[tuple[Finding, bool]]:
        """Each finding, and whether it happened after warm-up."""
        self._harvest()
        return self._break_findings() + self._recompile_findings() + self._limit_findings() + self._skip_findings()

    def _epoch_of(self, period: int) -> int:
        if period < len(self._epochs):
            return self._epochs[period]
        last = self._epochs[-1] if self._epochs else self._first_epoch - 1
        return last + 1 + period - len(self._epochs)

    def _break_findings(self) -> list[tuple[Finding, bool]]:
        sites = sorted(self._breaks.values(), key=lambda b: -len(b.periods))
        out = []
        for b in sites[:MAX_SITES]:
            where = f"{b.at} in {b.at.func}" if b.at else "a line dynamo did not record"
            source = b.at.source() if b.at else ""
            late = b.late
            explanation = _explanation(b.reason)
            evidence = (
                where + (f": `{source}`" if source else "")
                + (f" (called from {b.caller} in {b.caller.func})" if b.caller else "")
                + (f"; dynamo stopped inside {b.inner} in {b.inner.func}, which this line calls" if b.inner else "")
                + "; torch.compile splits the graph there, so every call runs this line in Python between "
                f"two compiled graphs; met in {len(b.periods)} compilation(s)"
                + (f", {late} after warm-up" if late else "")
                # generic_jump is dynamo's name for a branch on a tensor, and says no more than the title.
                + ("" if b.reason.startswith("generic_jump") else f"; torch: {_first_line(b.reason)}"
                   + (f" ({explanation})" if explanation else ""))
            )
            what = _BREAK_WHAT.get(b.kind) or _first_line(b.reason)
            fix = _break_fix(b.kind, b.reason)
            if b.inner is not None and b.kind not in _BREAK_FIX:
                fix = (f"The break is inside the library code this line calls ({b.inner.func}): move the call out "
                       "of forward (into the data pipeline, or after the step) or use torch ops instead. " + fix)
            elif b.at is not None and _third_party(b.at.file):
                package = _package(b.at.file)
                fix = (f"This line is {package}'s own code, not yours: look for the setting of {package} that "
                       "avoids it (a warning it logs once, outside torch.compile, often names it), or compile the "
                       "part of the model before it.")
            out.append((Finding("graph-break", f"graph break at {where}: {what}", evidence, fix), late > 0))
        rest = sites[MAX_SITES:]
        if rest:
            out.append((Finding(
                "graph-break", f"{len(rest)} more graph-break site(s)",
                "; ".join(f"{b.at}: {_BREAK_WHAT.get(b.kind) or _first_line(b.reason)} ({len(b.periods)}x)"
                          for b in rest),
                "Fix the sites above first: one graph break often causes the next.",
            ), any(b.late for b in rest)))
        return out

    def _guard_site(self, guard: dict[str, Any], c: _Compile) -> _Site | None:
        """The user's line that a guard came from, when dynamo names one."""
        if guard["frames"]:
            site = self._user_site(guard["frames"])[0]
            return site if site is not None and self._code.users(site.file) else None
        if guard["comment"]:
            path, line, func = guard["comment"]
            if not os.path.isabs(path) and c.file and c.file.endswith(path):
                path = c.file  # the comment keeps only the end of a long path
            site = _Site(path, line, func)
            return site if os.path.exists(path) and self._code.users(path) else None
        return None

    def _recompile_groups(self) -> list[dict[str, Any]]:
        groups: dict[tuple[Any, ...], dict[str, Any]] = {}
        for c in self._compiles:
            if not c.unexpected:
                continue
            guard = _parse_guard(c.cause or c.reason)
            key = (c.function, c.file, guard["kind"], guard["subject"])
            g = groups.setdefault(key, {"events": [], "guard": guard, "values": [], "changes": [], "compile": c,
                                        "user": self._guard_site(guard, c), "reset": self._reset_seen})
            g["events"].append(c)
            for name, item in (("values", guard["value"]), ("changes", guard["change"])):
                if item is not None and item not in g[name]:
                    g[name].append(item)
        return list(groups.values())

    def _recompile_findings(self) -> list[tuple[Finding, bool]]:
        out = []
        extra: list[dict[str, Any]] = []
        for g in self._recompile_groups():
            guard, events = g["guard"], g["events"]
            late = [c for c in events if c.late]
            if len(out) >= MAX_SITES:
                extra.append(g)
                continue
            warm = [c for c in events if not c.late]
            other_mode = [c for c in events if c.cause]
            epochs = sorted({self._epoch_of(c.period) for c in late})
            when = ", ".join(part for part in (
                f"{len(warm)} in warm-up (epoch {self._epoch_of(0)})" if warm else "",
                f"{len(late)} after warm-up (epoch{'s' if len(epochs) > 1 else ''} "
                f"{', '.join(map(str, epochs))})" if late else "",
            ) if part)
            subject, detail = _describe_guard(g)
            user: _Site | None = g["user"]
            where = self._function_site(g["compile"])
            evidence = (
                f"guard {guard['text']!r} failed"
                + (f" at {user} (`{user.source()}`)" if user else "")
                + f"; {detail}"
                + (f"; for {len(other_mode)} of them dynamo names the guard "
                   f"{_parse_guard(other_mode[0].reason)['text']!r}, which failed on a version of the other mode "
                   "(training and evaluation each compile their own); the guard above failed on their own mode's "
                   "version, so this same change compiled them again" if other_mode else "")
                + f"; {len(events)} recompilation(s): {when}; "
                f"{sum(c.seconds for c in events):.2f} s compiling"
                + (f"; torch's hint: {guard['hint']}" if guard["hint"] else "")
            )
            out.append((Finding("recompilation", f"{len(events)} recompilation(s) of {where}: {subject}",
                                evidence, _recompile_fix(guard, reset=g["reset"])), bool(late)))
        if extra:
            out.append((Finding(
                "recompilation", f"{len(extra)} more guard(s) that failed",
                "; ".join(f"{self._function_site(g['compile'])}: {g['guard']['text']!r} ({len(g['events'])}x)"
                          for g in extra),
                "Fix the recompilations above first; each new shape or Python value compiles a new graph.",
            ), any(c.late for g in extra for c in g["events"])))
        return out

    def _limit_findings(self) -> list[tuple[Finding, bool]]:
        out = []
        for c in self._compiles:
            if c.kind != "limit":
                continue
            guard = _parse_guard(c.reason)
            user = self._guard_site(guard, c)
            last = f"the last guard that failed: {guard['text']!r}" if c.reason else "no guard failure recorded"
            out.append((Finding(
                "recompile-limit",
                f"torch.compile reached its recompile limit{f' ({c.limit})' if c.limit else ''} on "
                f"{self._function_site(c)}: calls that match none of its compiled versions run eagerly",
                f"epoch {self._epoch_of(c.period)}{'' if c.late else ' (warm-up)'}; {last}"
                + (f" at {user} (`{user.source()}`)" if user else ""),
                (_recompile_fix(guard, reset=self._reset_seen) + " " if c.reason else "")
                + "Raising torch._dynamo.config.recompile_limit only delays the fallback.",
            ), c.late))
        return out

    def _skip_findings(self) -> list[tuple[Finding, bool]]:
        out = []
        seen = set()
        for c in self._compiles:
            key = (c.function, c.file, _first_line(c.failure))
            if c.kind != "skipped" or key in seen:
                continue
            seen.add(key)
            failure = c.failure or ""
            at = c.fail_at
            evidence = (
                (f"at {at} (`{at.source()}`): " if at and at.line else "") + _first_line(failure)
                + (f" ({_explanation(failure)})" if _explanation(failure) else "")
                + ("; the graph break is inside a for/while loop, so dynamo gives up on the whole function"
                   if "graph break in loop" in failure else "")
            )
            out.append((Finding("compile-skipped", f"torch.compile skipped {self._function_site(c)}: it runs eagerly",
                                evidence, _break_fix(_break_kind(failure), failure)), c.late))
        return out

    def _function_site(self, c: _Compile) -> str:
        """``forward (model.py:12)``, or what the compiled frame is when it is not the user's code."""
        if c.file is None:
            return c.function
        resume = _RESUME.match(c.function)
        if resume:
            return f"{resume['func']} after its graph break at {_short(c.file)}:{resume['line']}"
        site = _Site(c.file, int(c.line or 0), c.function)
        if self._code.in_torch(c.file):
            # torch.compile(nn.Sequential(...)) compiles a wrapper of torch's own around the module's call.
            return f"the compiled module (torch's wrapper {c.function} at {site})"
        return f"{c.function} ({site})"

    def notes(self) -> list[str]:
        """What needs no change, or what could not be told."""
        self._harvest()
        out = []
        warm = [c for c in self._compiles if not c.late and c.kind == "compile"]
        if warm:
            out.append(f"torch.compile warm-up: {len(warm)} compilation(s), {self._warm_s:.1f} s")
        expected = [c for c in self._compiles if c.expected]
        if expected:
            epochs = sorted({self._epoch_of(c.period) for c in expected})
            out.append(
                f"torch.compile: evaluation compiled its own version of {len(expected)} function(s) (grad mode or "
                f"model.eval() differ from training) in epoch{'s' if len(epochs) > 1 else ''} "
                f"{', '.join(map(str, epochs))}, once each, as a clean run does"
            )
        if self._lost:
            out.append("torch.compile: some compilations could not be read (dynamo's ring of compilation "
                       "metrics moved past them), so the counts are a lower bound")
        if self._reset_seen:
            out.append("torch.compile: torch._dynamo.reset() ran during the run; compilations before and "
                       "after it are both counted")
        if len(self._compiles) > MAX_EVENTS:
            out.append(f"torch.compile: {len(self._compiles) - MAX_EVENTS} compilation(s) past the first "
                       f"{MAX_EVENTS} are counted but not listed in diagnostics.json")
        return out

    def summary(self) -> dict[str, Any]:
        """Numbers for diagnostics.json.

        Keys: ``graphs``, ``compilations``, ``recompilations`` (all), ``recompilations_for_evaluation``
        (the first version of a function for no_grad / model.eval(), as a clean run compiles), and
        ``recompilations_after_warm_up`` (the others, after the first epoch, or after its warm-up
        steps when told by :meth:`at`),
        ``graph_breaks`` (met while compiling), ``graph_break_sites``, ``recompile_limit_hits``,
        ``skipped``, ``compile_s`` and ``events``: one per compilation (epoch, function, file:line,
        kind, the guard that failed, seconds; ``cause``: the guard that failed on the version of the
        call's own mode, where dynamo named another mode's), the first ``MAX_EVENTS``.
        """
        self._harvest()
        compiles = self._compiles
        return {
            "graphs": self._graphs,
            "compilations": sum(1 for c in compiles if c.kind == "compile"),
            "recompilations": sum(1 for c in compiles if c.recompile),
            "recompilations_for_evaluation": sum(1 for c in compiles if c.expected),
            "recompilations_after_warm_up": sum(1 for c in compiles if c.unexpected and c.late),
            "graph_breaks": sum(len(b.periods) for b in self._breaks.values()),
            "graph_break_sites": len(self._breaks),
            "recompile_limit_hits": sum(1 for c in compiles if c.kind == "limit"),
            "skipped": sum(1 for c in compiles if c.kind == "skipped"),
            "compile_s": round(sum(self._seconds.values()), 3),
            "events": [
                {"epoch": self._epoch_of(c.period), "warm_up": not c.late, "compile_id": c.compile_id,
                 "kind": c.kind, "function": c.function,
                 "at": f"{_short(c.file)}:{c.line}" if c.file else None,
                 "guard_failed": _parse_guard(c.reason)["text"] if c.reason else None,
                 **({"cause": _parse_guard(c.cause)["text"]} if c.cause else {}),
                 "failure": _first_line(c.failure) or None, "seconds": round(c.seconds, 3)}
                for c in compiles[:MAX_EVENTS]
            ],
        }


# --- reading torch --------------------------------------------------------------------------------
def _third_party(path: str) -> bool:
    return f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


def _package(path: str) -> str:
    """The installed package a site-packages path lies in (``transformers``)."""
    parts = path.split(os.sep)
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages"):
            return parts[i + 1].removesuffix(".py")
    return "a library"


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if rel.startswith("..") else rel


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _recompile_limit(failure: str | None) -> int | None:
    """The limit dynamo reached: from its message, else from its config now."""
    from torch._dynamo import config

    stated = re.search(r"currently set to (\d+)", failure or "")
    if stated:
        return int(stated.group(1))
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6; the old name is an alias
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _frame_of_guard_failure(reason: str) -> tuple[str | None, str | None, int | None]:
    """The compiled function a guard failure belongs to, from dynamo's record of failures per code."""
    from torch._dynamo import utils

    for code, failures in list(utils.guard_failures.items()):
        if reason in failures:
            return code.co_name, code.co_filename, code.co_firstlineno
    return None, None, None


def _first_line(text: str | None) -> str:
    return (text or "").strip().split("\n", 1)[0].strip()


def _explanation(text: str) -> str:
    match = re.search(r"Explanation: (.*)", text or "")
    return match.group(1).strip() if match else ""


# --- graph breaks ---------------------------------------------------------------------------------
_BREAK_WHAT = {
    "branch": "Python `if` on a tensor value (data-dependent control flow)",
    "item": "a tensor read into Python (.item() / .tolist())",
    "print": "print or logging inside the compiled code",
    "dynamic-shape": "an op whose output shape depends on the data",
    "numpy": "NumPy inside the compiled code",
    "explicit": "torch._dynamo.graph_break()",
    "skipped-call": "a call torch.compile does not trace",
}

_BREAK_FIX = {
    "branch": ("Keep Python control flow on tensor values out of forward: compute both branches and pick with "
               "torch.where, clamp instead of testing, or use torch.cond for a real branch; a decision that "
               "is the same for every batch belongs outside the model."),
    "item": ("Keep .item() / .tolist() out of forward: return the tensor (the Trainer sums metrics on the "
             "device and reads them every log_every steps) or keep the value on the device (torch.where "
             "instead of `if`); torch._dynamo.config.capture_scalar_outputs = True keeps it in the graph when "
             "the number only feeds tensor ops."),
    "print": ("Remove print / logging from forward (log outside the compiled model, after the step); printing a "
              "tensor also reads it from the device."),
    "dynamic-shape": ("Use fixed-shape ops: torch.where or a mask instead of boolean indexing, nonzero or "
                      "unique; pad to a fixed size."),
    "numpy": "Use torch ops instead of NumPy inside forward, or move the NumPy work into the data pipeline.",
    "explicit": "Remove torch._dynamo.graph_break() from the model.",
    "skipped-call": "Move the call out of forward (into the data pipeline, or after the step), or use torch ops.",
}


def _break_kind(reason: str) -> str:
    head = _first_line(reason)
    text = (head + " " + _explanation(reason)).lower()
    if head.startswith("generic_jump") or "data-dependent branching" in text:
        return "branch"
    if ".item()" in text or "tolist" in text:
        return "item"
    if "`print`" in text or "logging" in text:
        return "print"
    if "dynamic shape operator" in text or "data dependent operator" in text:
        return "dynamic-shape"
    if "numpy" in text:
        return "numpy"
    if "torch._dynamo.graph_break()" in text:
        return "explicit"
    if "marked as skipped" in text:
        return "skipped-call"
    return "other"


def _break_fix(kind: str, reason: str) -> str:
    if kind in _BREAK_FIX:
        return _BREAK_FIX[kind]
    hints = [h.strip() for h in re.findall(r"Hint: (.*)", reason or "") if "report an issue" not in h.lower()]
    return ("torch's hints: " + " ".join(hints)) if hints else (
        "Move the code torch.compile cannot trace out of forward, or write it with torch ops.")


# --- recompilations -------------------------------------------------------------------------------
def _parse_guard(reason: str | None) -> dict[str, Any]:
    """Dynamo's guard-failure text -> its kind, the guard, what it names, a value, the user's frames.

    Dynamo writes ``0/1: <guard>  # <source line>  # <file:line> in <function> (HINT: ...)`` and,
    for guards made from user code, ``User stack trace:`` with the frames; tensor guards read
    ``tensor 'x' size mismatch at index 0. expected 16, actual 8``.
    """
    text = reason or ""
    head = _COMPILE_ID.sub("", text.split("\n", 1)[0], count=1)
    hint = _HINT.search(head)
    if hint:
        head = head[:hint.start()]
    guard = head.split(" #", 1)[0].strip()
    comment = _COMMENT.search(head)
    out: dict[str, Any] = {
        "text": guard, "hint": hint.group("hint") if hint else "", "kind": "other", "subject": guard,
        "value": None, "change": None,
        "frames": [_Site(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(text)],
        # Torch 2.9 gives no user stack, only the comment, whose path may lose its start.
        "comment": (comment["path"], int(comment["line"]), comment["func"]) if comment else None,
    }
    tensor = _TENSOR.search(guard)
    equals = _EQUALS.match(guard)
    if tensor:
        what, index = tensor["what"].strip(), tensor["index"]
        dim = f" dim {index}" if index is not None else ""
        name = tensor["name"]
        if tensor["actual"]:
            change = f"'{name}'{dim} {tensor['expected']} -> {tensor['actual']}"
        else:
            change = f"'{name}' {what}" + (f" (compiled for {tensor['expected']})" if tensor["expected"] else "")
        out.update(kind="tensor", subject=(name, what, index), change=change, what=what, name=name)
    elif "GLOBAL_STATE changed" in guard or re.search(r"\.training\s*==\s*(True|False)", guard):
        out.update(kind="mode")
    elif equals:
        expr = equals["expr"].strip()
        out.update(kind="stack" if "___stack" in expr else "value", subject=expr, value=equals["value"].strip(),
                   expr=expr)
    elif not guard or guard.startswith("Unable to find recompilation reasons"):
        out.update(kind="unknown", subject="")
    return out


def _listed(items: list[str], sep: str) -> str:
    more = len(items) - MAX_VALUES
    return sep.join(items[:MAX_VALUES]) + (f"{sep}and {more} more" if more > 0 else "")


def _describe_guard(group: dict[str, Any]) -> tuple[str, str]:
    """(what changed, in a few words; the evidence in detail) for one group of recompilations."""
    guard = group["guard"]
    kind = guard["kind"]
    if kind == "tensor":
        changes = _listed(group["changes"], "; ")
        if guard["what"] == "size":
            batch = " (the batch size changed: a ragged last batch, or batches of varying size)" if (
                guard["subject"][2] == "0") else ""
            return (f"tensor '{guard['name']}' changed shape",
                    f"compiled for one size, called with another: {changes}{batch}")
        return f"tensor '{guard['name']}' changed {guard['what']}", changes
    if kind == "value":
        values = _listed(group["values"], ", ")
        return (f"the Python value {guard['expr']} changed",
                f"{guard['expr']} is a Python number or attribute baked into the graph as a constant; compiled for "
                f"{guard['expr']} == {values}, then called with another value")
    if kind == "stack":
        values = _listed(group["values"], ", ")
        return ("a value read from a tensor at the graph break is a constant of the code after it",
                f"the code after the graph break was compiled for {guard['expr']} == {values}, the value read "
                "then; another value compiled it again")
    if kind == "mode":
        return ("grad mode or train/eval mode changed after warm-up",
                "training and evaluation each compile their version once, the first time each runs; this one "
                "compiled again, and dynamo recorded only the mode guard of another mode's version, not why this "
                "mode's own version no longer fitted" + ("" if group.get("reset") else
                                                          " (TORCH_LOGS=recompiles_verbose lists every version's)"))
    if kind == "unknown":
        return "dynamo did not record which guard failed", "no guard failure was recorded"
    return f"guard {guard['text']!r} failed", "a condition the compiled graph assumed no longer held"


def _recompile_fix(guard: dict[str, Any], reset: bool = False) -> str:
    kind = guard["kind"]
    if kind == "tensor" and guard.get("what") == "size":
        return ("Keep every batch one shape: drop_last=True for training (the Trainer's samplers do), pad the "
                "last evaluation batch (the Trainer does), resize or pad variable-size inputs, bucket "
                "variable lengths into a few fixed sizes. Mark a dimension dynamic "
                "(torch._dynamo.mark_dynamic(t, dim)) only where shapes truly vary; on TorchTPU "
                "(dynamic=False) every new shape compiles a graph of its own.")
    if kind == "tensor":
        return (f"Give the tensor the same {guard.get('what', 'properties')} on every call (set it in the data "
                "pipeline or before the compiled call).")
    if kind == "value":
        return (f"Keep {guard['expr']} constant during training, or make it a tensor (register_buffer, or pass it "
                "as an input) so that it enters the graph as data, not as a constant.")
    if kind == "stack":
        return ("Keep values read from tensors (.item(), .tolist(), int(t)) out of the compiled code: compute "
                "with the tensor itself, decide with torch.where or torch.cond, or read it after the step.")
    if kind == "mode" and reset:
        return ("Keep the compiled training and evaluation versions: do not call torch._dynamo.reset() during "
                "the run.")
    if kind == "mode":
        return ("Run with TORCH_LOGS=recompiles_verbose to see the guard that failed on this mode's own version, "
                "and keep what it tests the same on every call (or make it a tensor input); call the compiled "
                "model only in the modes the Trainer uses (model.train() with gradients, model.eval() under "
                "no_grad).")
    return (f"Keep what the guard {guard['text']!r} tests the same on every call, or make it a tensor input.")
