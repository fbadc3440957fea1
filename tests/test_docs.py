"""Every shell and Python block of README.md and of every page under docs/ runs as written, or,
where it needs a TPU, a GPU, the network or another machine, everything it names exists.

Each page's Python blocks run in order in one interpreter, in a fresh directory per page
(``configs/`` linked in), as a reader pasting them would; every page's shell lines run once, one
after another in one directory in reading order (README first), as a reader working through the
pages runs them (the pages in the site's order, mkdocs.yml's nav): a command refused for what an
earlier one left behind (a run directory holding another run) fails there. ``make demo`` runs its recipe (``xlatrain demo``); other Make
targets are checked by name.
Sizes are made tiny: ``xlatrain fit`` lines get a recipe's tiny-data overrides appended (later
``--set`` wins), ``xlatrain demo`` trains one epoch, and a block may carry
``<!-- docs-test: tiny: OLD => NEW -->`` substitutions (one directive per marker line, the lines
right above the block) (``{root}`` is the repository). A
block marked ``<!-- docs-test: skip: WHY -->`` is not run (the reason is reported); one marked
``<!-- docs-test: names -->`` is checked by name only; one marked ``<!-- docs-test: exits: 2 -->``
must end with that status (a refusal the page shows); a Python block marked
``<!-- docs-test: after-shell -->`` reads what its page's shell lines made, and they run before it. Commands are classified by what they need:
``accelerator=tpu`` / ``cuda`` / ``PJRT_DEVICE=TPU``, TorchTPU's launcher, ``gcloud`` and ``pip``
are checked by name (the subcommand and flags parse, each ``--set`` key exists in the config,
modules and Make targets exist); everything else runs. TorchTPU's launches also run in bash, with
a stand-in for its module (printing what it prints) and for torchrun (recording what it was
given). Commands run in the tests' script environment (conftest.script_env), with two differences
a reader would not have: XLA:CPU generates code at LLVM optimization level 0 (``XLA_FLAGS``),
which changes how long XLA commands compile and how fast their code runs, not what the pages
describe; faulthandler is on (``PYTHONFAULTHANDLER``), so a command that hangs prints its
threads' stacks when it is stopped; and a Python command may run forked from an interpreter
that has imported torch already (tests/warm.py), which changes how long it takes to start, not
what it does.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_bounded, script_env

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Make targets whose recipe a reader's `make TARGET` runs here (with the tiny sizes); the others
# (builds, the test suite, benchmarks) are checked by name.
MAKE_RUNS = {"demo"}


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def nav_pages() -> list[Path]:
    """The site's pages in the order of mkdocs.yml's nav."""
    import yaml

    def entries(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [p for v in node.values() for p in entries(v)]
        if isinstance(node, list):
            return [p for v in node for p in entries(v)]
        return []

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text()).get("nav", [])
    return [ROOT / "docs" / p for p in entries(nav) if p.endswith(".md")]


def reading_order() -> list[Path]:
    """README, then the site's pages in the order of its navigation, then any page it leaves out."""
    ordered = nav_pages()
    return [ROOT / "README.md", *ordered, *(p for p in PAGES[1:] if p not in ordered)]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"
COMMAND_TIMEOUT_S = 200

# What makes a recipe's run tiny (appended after the line's own --set, so it wins).
TINY = {
    "configs/digits.yaml": ["trainer.epochs=1", "data.image_size=16"],
    "configs/pe_detection.yaml": ["trainer.epochs=1", "trainer.batch_size=4", "data.num_studies=6",
                                  "data.slices_per_study=[4,5]", "data.stored_size=48", "data.image_size=32",
                                  "data.num_folds=3", "data.pack_workers=1", "trainer.num_workers=0"],
    "configs/depth_mask.yaml": ["trainer.epochs=1", "trainer.batch_size=4", "data.num_train=8", "data.num_val=4",
                                "data.image_size=32", "model.width=8", "model.blocks=[1,1,1,1]"],
    "configs/lm.yaml": ["trainer.epochs=1", "trainer.batch_size=8", "data.max_train_bytes=20000",
                        "data.max_val_bytes=4000", "data.context=32", "model.width=32", "model.layers=1",
                        "model.heads=2", "schedule.warmup_steps=2"],
}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None = None
    names_only: bool = False
    exits: int = 0  # the exit status its commands end with (a refusal the page shows: 2)
    tiny: list[tuple[str, str]] = field(default_factory=list)
    after_shell: bool = False  # a Python block that reads what its page's shell commands made

    def prepared(self) -> str:
        code = self.code
        for old, new in self.tiny:
            assert old in code, f"{self.page}:{self.line}: tiny substitution {old!r} no longer matches the block"
            code = code.replace(old, new.replace("{root}", str(ROOT)))
        return code


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        line = text[: m.start()].count("\n") + 1
        before = text[: m.start()].rstrip().splitlines()
        block = Block(page_id(page), line, m.group(1), m.group(2))
        directives = []
        while before and MARK.fullmatch(before[-1].strip()):  # one directive per marker line
            directives.insert(0, MARK.fullmatch(before.pop().strip()).group(1).strip())
        if directives:
            for directive in directives:
                if directive.startswith("skip:"):
                    block.skip = directive[len("skip:"):].strip()
                elif directive == "names":
                    block.names_only = True
                elif directive == "after-shell":
                    block.after_shell = True
                elif directive.startswith("exits:"):
                    block.exits = int(directive[len("exits:"):])
                elif directive.startswith("tiny:"):
                    old, new = directive[len("tiny:"):].split("=>")
                    block.tiny.append((old.strip(), new.strip()))
                else:
                    raise AssertionError(f"{page_id(page)}:{line}: unknown docs-test directive {directive!r}")
        found.append(block)
    return found


def commands(code: str) -> list[str]:
    """Logical shell lines: continuations joined, comments and blank lines dropped."""
    joined = code.replace("\\\n", " ")
    out = []
    for raw in joined.splitlines():
        tokens = shlex.split(raw, comments=True)
        if tokens:
            out.append(raw)
    return out


# --- checking a command by name ---------------------------------------------------------------

def _check_xlatrain(argv: list[str]) -> None:
    """The subcommand and its flags parse; a fit's config loads with every ``--set``."""
    from xlatrain.cli import build_parser

    argv = [a for a in argv if a != "--debug"]
    args = build_parser().parse_args(argv)
    if args.command == "fit":
        from xlatrain.config import load_run_config

        load_run_config(str(ROOT / args.config), args.set)


def _split_env(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    return env, tokens


def _xlatrain_argv(tokens: list[str]) -> list[str] | None:
    """The xlatrain arguments of a command that runs xlatrain (directly, -m, or under torchrun)."""
    if Path(tokens[0]).name == "xlatrain":
        return tokens[1:]
    if "-m" in tokens:
        i = tokens.index("-m")
        if i + 1 < len(tokens) and tokens[i + 1] == "xlatrain.cli":
            return tokens[i + 2:]
    return None


def _needs_hardware(env: dict[str, str], text: str) -> str | None:
    if env.get("PJRT_DEVICE") == "TPU":
        return "a TPU (PJRT_DEVICE=TPU)"
    if re.search(r"accelerator[= ](tpu|cuda)", text):
        return "a " + re.search(r"accelerator[= ](tpu|cuda)", text).group(1).upper()
    if re.search(r"\$\{?(WORLD_SIZE|NNODES)\b", text):
        return "TorchTPU's launch variables"
    return None


def check_names(command: str) -> str:
    """Check what ``command`` names without running it; returns what was checked."""
    if command.lstrip().startswith("("):  # a subshell (TorchTPU's launch): each command in it
        inner = re.fullmatch(r"\s*\((.*?)\)\s*(?:#.*)?", command, re.S)
        assert inner, f"cannot check {command}"
        parts = [part.strip() for part in re.split(r"&&|;", inner.group(1))]
        checked = [check_names(part) for part in parts if part and part not in ("set -a", "set +a")]
        return "in a subshell: " + "; ".join(checked)
    env, tokens = _split_env(shlex.split(command, comments=True))
    prog = Path(tokens[0]).name
    if prog == "make":
        proc = subprocess.run(["make", "-n", "-C", str(ROOT), *tokens[1:]], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"make -n {' '.join(tokens[1:])}: {proc.stderr}"
        return f"make target {' '.join(tokens[1:])} exists"
    if prog == "pip":
        extras = set(re.findall(r"xlatrain\[(\w+)\]", command))
        declared = open(ROOT / "pyproject.toml").read()
        for extra in extras:
            assert re.search(rf"^{extra} = \[", declared, re.M), f"pyproject.toml has no extra [{extra}]"
        return f"extras {sorted(extras)} exist"
    if prog in ("set", "eval"):  # TorchTPU's launch variables (run with a stand-in module below)
        assert "torch.tpu.distributed" in command, f"cannot check {command}"
        spec = importlib.util.find_spec("torch_tpu")
        if spec is None:
            return "TorchTPU not installed in this environment: launcher not checked"
        root = Path(spec.origin).parent
        assert (root / "_internal" / "distributed" / "distributed.py").is_file(), "torch_tpu has no distributed launcher"
        return "TorchTPU's launcher module exists"
    if prog == "gcloud":
        inner = re.search(r"--command=(['\"])(.*)\1", command, re.S)
        assert inner, f"gcloud line without --command: {command}"
        checked = []
        for part in re.split(r"&&|;", inner.group(2)):
            part = part.strip()
            if part and not part.startswith(("cd ", "eval ", "set ", "export ")):
                checked.append(check_names(part))
        return "inside gcloud: " + "; ".join(checked)
    if prog == "tensorboard":
        assert importlib.util.find_spec("tensorboard") is not None
        return "tensorboard is installed"
    if prog == "torchrun":
        argv = _xlatrain_argv(tokens)
        assert argv is not None, f"torchrun of something else: {command}"
        _check_xlatrain(argv)
        return "torchrun's xlatrain arguments parse"
    argv = _xlatrain_argv(tokens)
    if argv is not None:
        _check_xlatrain(argv)
        return "xlatrain arguments parse"
    if prog.startswith("python"):
        assert "-m" in tokens, f"cannot check {command}"
        module = tokens[tokens.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        return f"module {module} exists"
    raise AssertionError(f"no way to check {command!r}: run it, or mark its block")


# --- running a command ------------------------------------------------------------------------

def reader_env(env: dict[str, str]) -> dict[str, str]:
    """A reader's environment: none of the test scripts on the path, and this checkout's xlatrain
    (its src/ first: an environment's editable install may point at another checkout)."""
    full_env = script_env(env)
    full_env["PYTHONPATH"] = str(ROOT / "src")
    return full_env


def make_recipe(target: str) -> list[str]:
    """The commands ``make TARGET`` runs once the environments are built (their build steps left out)."""
    built = [".venv/.installed", ".venv/.site-hook", ".venv-xla/.installed"]
    proc = subprocess.run(["make", "-s", "-n", "-C", str(ROOT), *(f"-o{b}" for b in built), target],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"make -n {target}: {proc.stderr}"
    return [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("make")]


def run_command(command: str, cwd: Path, exits: int = 0) -> str:
    env, tokens = _split_env(shlex.split(command, comments=True))
    if tokens[0] == "source":
        return "skipped: activation"
    if tokens[0] == "make" and len(tokens) == 2 and tokens[1] in MAKE_RUNS:
        ran = [run_command(line, cwd, exits) for line in make_recipe(tokens[1])]
        return f"ran its recipe ({'; '.join(ran)})"
    needs = _needs_hardware(env, command)
    if needs or Path(tokens[0]).name in ("make", "pip", "(", "set", "eval", "gcloud", "tensorboard"):
        return f"checked ({needs or Path(tokens[0]).name}): {check_names(command)}"
    python = sys.executable
    if tokens[0].startswith(".venv-xla/"):
        if not XLA_PYTHON.exists():
            return f"checked (no .venv-xla here): {check_names(command)}"
        python = str(XLA_PYTHON)
    argv = _xlatrain_argv(tokens)
    if tokens[0] == "torchrun":
        launcher = [str(Path(sys.executable).parent / "torchrun"), *tokens[1:tokens.index("-m")], "-m", "xlatrain.cli"]
    elif argv is not None:
        launcher = [python, "-m", "xlatrain.cli"]
    elif Path(tokens[0]).name.startswith("python"):
        launcher, argv = [python, *tokens[1:]], []
    else:
        raise AssertionError(f"no way to run {command!r}: mark its block")
    if argv and argv[0] == "fit" and argv[1] in TINY and "--help" not in argv:
        for item in TINY[argv[1]]:
            argv = [*argv, "--set", item]
    if argv and argv[0] == "demo":
        argv = [*argv, "--epochs", "1", "--min-accuracy", "0"]
    full_env = reader_env({**env, "XLATRAIN_CACHE_DIR": str(cwd / ".cache")})
    # Each command takes seconds at the tiny sizes (at most ~40 s measured, loaded); well under the
    # test's own limit, so that a command that hangs is named with what it printed and where it was.
    try:
        proc = run_bounded([*launcher, *argv], full_env, COMMAND_TIMEOUT_S, cwd=cwd, warm=True)
    except AssertionError as exc:
        raise AssertionError(f"`{command}`: {exc}") from None
    assert proc.returncode == exits, f"`{command}` exited {proc.returncode}:\n{proc.stdout[-2500:]}\n{proc.stderr[-2500:]}"
    return "ran" if exits == 0 else f"ran, exited {exits} as the page says"


def _session_dir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")
    return work


def shell_steps(page: Path) -> list[tuple[Block, str | None]]:
    """A page's shell blocks as a reader runs them: (block, command) in order; (block, None) for a
    block that is skipped."""
    steps: list[tuple[Block, str | None]] = []
    for block in blocks(page):
        if block.lang not in ("bash", "sh"):
            continue
        if block.skip:
            steps.append((block, None))
            continue
        steps += [(block, command) for command in commands(block.prepared())]
    return steps


def run_step(block: Block, command: str | None, work: Path) -> str:
    if command is None:
        return f"{block.page}:{block.line} skipped: {block.skip}"
    started = time.perf_counter()
    outcome = check_names(command) if block.names_only else run_command(command, work, block.exits)
    return f"{block.page}:{block.line} `{command.strip()[:70]}`: {outcome} ({time.perf_counter() - started:.1f} s)"


@pytest.mark.parametrize("page", [page_id(p) for p in PAGES])
def test_every_block_of_the_page_runs_as_written_or_names_what_exists(page, tmp_path):
    path = ROOT / page
    found = blocks(path)
    work = _session_dir(tmp_path)
    python_blocks = [b for b in found if b.lang == "python"]
    # Shell commands run in the reading order of every page in one directory (test_docs_in_order.py:
    # README first, in a fresh directory). Here they run only on a page with a Python block
    # marked ``<!-- docs-test: after-shell -->`` (it reads what they made: packed data, a run
    # directory); elsewhere only those checked by name.
    feeds_python = any(b.after_shell and not b.skip for b in python_blocks)
    report = [run_step(block, command, work) if feeds_python or block.names_only or command is None
              else f"{block.page}:{block.line} `{command.strip()[:70]}`: run in the one-directory test"
              for block, command in shell_steps(path)]
    session = []
    for block in python_blocks:
        if block.skip:
            report.append(f"{page}:{block.line} skipped: {block.skip}")
        elif block.names_only:
            compile(block.code, f"{page}:{block.line}", "exec")
            report.append(f"{page}:{block.line}: compiles (names only)")
        else:
            session.append({"page": page, "line": block.line, "code": block.prepared()})
    if session:
        (tmp_path / "blocks.json").write_text(json.dumps(session))
        env = reader_env({"XLATRAIN_CACHE_DIR": str(work / ".cache")})
        proc = run_bounded([sys.executable, str(SCRIPTS / "doc_session.py"), str(tmp_path / "blocks.json")], env, 900, cwd=work,
                           warm=True)
        assert proc.returncode == 0, f"{page}: a Python block failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
        report += [f"{page}:{b['line']}: ran" for b in session]
    print("\n".join(report))


def test_every_page_under_docs_is_in_the_sites_navigation_once():
    nav = nav_pages()
    assert len(nav) == len(set(nav)), f"a page is in mkdocs.yml's nav twice: {[page_id(p) for p in nav]}"
    assert not [p for p in nav if not p.is_file()], "mkdocs.yml's nav names a page that does not exist"
    missing = sorted(page_id(p) for p in set(PAGES[1:]) - set(nav))
    assert not missing, f"pages under docs/ that mkdocs.yml's nav leaves out (add them to nav): {missing}"


def test_every_marked_block_says_why_and_every_block_is_one_the_harness_knows():
    assert any(page_id(p).count("/") > 1 for p in PAGES), "pages in docs/ subfolders are read too"
    for page in PAGES:
        for block in blocks(page):
            where = f"{page_id(page)}:{block.line}"
            assert block.lang in ("bash", "sh", "python", "", "yaml", "text"), f"{where}: {block.lang}"
            if block.skip is not None:
                assert len(block.skip) > 10, f"{where}: say why the block is not run"


# --- TorchTPU's launch variables ---------------------------------------------------------------

# What `python -m torch.tpu.distributed` prints (torch_tpu's _print_launch_env): plain NAME="value"
# lines, no `export`, on one host of 4 devices and on the second of two such hosts.
LAUNCH_ENV = {
    "one host": 'TORCH_TPU_TOPOLOGY="2,2,1"\n'
                'TORCH_TPU_SLICEBUILDER_ADDRESSES="localhost:8471,localhost:8472,localhost:8473,localhost:8474"\n'
                'TORCH_TPU_XPROF_SESSION_ID="17"\nWORLD_SIZE=4\nNODE_RANK="0"\n',
    "two hosts": 'TORCH_TPU_TOPOLOGY="2,2,1"\n'
                 'TORCH_TPU_SLICEBUILDER_ADDRESSES="host-a:8070,host-a:8071,host-a:8072,host-a:8073,'
                 'host-b:8070,host-b:8071,host-b:8072,host-b:8073"\n'
                 'TORCH_TPU_XPROF_SESSION_ID="17"\nWORLD_SIZE=8\nNODE_RANK="1"\nNNODES="2"\n'
                 'MASTER_ADDR="host-a"\nMASTER_PORT="29500"\n',
}
# What torchrun's workers need from it: every rank must see the same values.
WORKER_VARS = ("TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_XPROF_SESSION_ID")


def tpu_launches() -> list[tuple[str, str]]:
    """Each TorchTPU launch the pages show, as shell text: the line that reads the launch variables
    and runs torchrun (or, written as two lines, that line and the torchrun line after it), or a
    gcloud line's remote command; and the devices=N hint's (tests/backend/test_tpu_launch.py)."""
    from xlatrain.backend import TPU_LAUNCH_ENV, torchrun_command

    found = [("the devices=N hint", f"( {TPU_LAUNCH_ENV}; {torchrun_command(4, ['train.py'])} )")]
    for page in PAGES:
        for block in blocks(page):
            if block.lang not in ("bash", "sh"):
                continue
            lines = commands(block.code)
            for i, line in enumerate(lines):
                if "torch.tpu.distributed" not in line:
                    continue
                where = f"{block.page}:{block.line}"
                if line.lstrip().startswith("gcloud"):
                    found.append((f"{where} gcloud", re.search(r"--command=(['\"])(.*)\1", line).group(2)))
                elif "torchrun" in line:
                    found.append((where, line))
                else:
                    assert i + 1 < len(lines) and "torchrun" in lines[i + 1], f"{where}: no torchrun after {line!r}"
                    found.append((where, line + "\n" + lines[i + 1]))
    return found


def _launch(script: str, printed: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict, list[str] | None]:
    """Run a launch in bash with the module printing ``printed`` and a torchrun that records its
    arguments and the environment its workers would inherit."""
    (tmp_path / "xlatrain").mkdir(exist_ok=True)  # a gcloud command's `cd xlatrain`
    (tmp_path / "printed").write_text(printed)
    torchrun = tmp_path / "torchrun"
    torchrun.write_text('#!/bin/sh\nenv > "$OUT/env"\nprintf "%s\\n" "$@" > "$OUT/args"\n')
    torchrun.chmod(0o755)
    for name in ("env", "args"):
        (tmp_path / name).unlink(missing_ok=True)
    script = re.sub(r"[\w./-]*torchrun(?=\s)", str(torchrun), script)
    script = re.sub(r"[\w./-]*python[\w.]* -m torch\.tpu\.distributed", f"cat {tmp_path / 'printed'}", script)
    proc = subprocess.run(["bash", "-c", script], env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=30)
    if not (tmp_path / "args").exists():
        return proc, {}, None
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    return proc, env, (tmp_path / "args").read_text().splitlines()


@pytest.mark.parametrize("where,script", [pytest.param(w, s, id=w) for w, s in tpu_launches()])
def test_each_torchtpu_launch_hands_torchrun_and_its_workers_the_launch_variables(where, script, tmp_path):
    multi_host = "--nnodes" in script
    printed = LAUNCH_ENV["two hosts" if multi_host else "one host"]
    values = dict(re.fullmatch(r'(\w+)="?(.*?)"?', line).groups() for line in printed.splitlines())
    proc, env, args = _launch(script, printed, tmp_path)
    assert proc.returncode == 0 and args is not None, f"{where}: {proc.stderr}"
    missing = [name for name in WORKER_VARS if env.get(name) != values[name]]
    assert not missing, f"{where}: torchrun's workers do not see {missing}: the module prints plain assignments, export them"

    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    num_hosts = int(flag("--nnodes")) if multi_host else 1
    num_addresses = len(values["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(","))
    assert int(flag("--nproc-per-node")) * num_hosts == num_addresses, f"{where}: not one process per device: {args}"
    if multi_host:
        passed = (flag("--node-rank"), flag("--master-addr"), flag("--master-port"))
        assert passed == (values["NODE_RANK"], values["MASTER_ADDR"], values["MASTER_PORT"]), where
        # Where the module takes its single-host path (no TPU_WORKER_HOSTNAMES), the launch stops.
        proc, _, args = _launch(script, LAUNCH_ENV["one host"], tmp_path)
        assert proc.returncode != 0 and args is None, f"{where}: a multi-host launch went on with one host's variables"
    if where == "the devices=N hint":  # its torchrun starts the devices=N processes asked for
        return
    # Where the module printed nothing (it failed, its error on stderr), torchrun does not start.
    proc, _, args = _launch(script, "", tmp_path)
    assert proc.returncode != 0 and args is None, f"{where}: torchrun started without TorchTPU's launch variables"


# A launch typed into a shell leaves nothing set there: torch_tpu keeps a launch variable that is
# already set (set_tpu_launch_env never overwrites one), so a later launch would reuse this one's
# slice-builder ports and xprof session; where the module then fails, ${WORLD_SIZE:?} would not stop
# torchrun; and a later plain `xlatrain fit` would see WORLD_SIZE. A gcloud launch is left out: its
# remote command is the whole of its ssh session's shell on each host.
LOCAL_LAUNCHES = [pytest.param(w, s, id=w) for w, s in tpu_launches() if not w.endswith(" gcloud")]


@pytest.mark.parametrize("where,script", LOCAL_LAUNCHES)
def test_each_torchtpu_launch_leaves_no_launch_variable_in_the_shell_it_was_typed_into(where, script, tmp_path):
    printed = LAUNCH_ENV["one host"]
    launch_vars = [line.split("=")[0] for line in printed.splitlines()]
    session = "\n".join([
        script,
        'compgen -v > "$OUT/shell_vars"; env > "$OUT/later_env"',  # the shell's variables; a later command's environment
        f'rm -f "$OUT/args"; : > {tmp_path / "printed"}',  # the module fails (prints nothing) at the next launch
        script,
    ])
    proc, _, args = _launch(session, printed, tmp_path)
    shell_vars = set((tmp_path / "shell_vars").read_text().split())
    later_env = {line.split("=", 1)[0] for line in (tmp_path / "later_env").read_text().splitlines()}
    left = [name for name in launch_vars if name in shell_vars or name in later_env]
    assert not left, f"{where}: the launch leaves {left} set in the shell it ran in: run it in a subshell, ( ... )"
    assert not any(name.startswith("TORCH_TPU_") for name in shell_vars | later_env), where
    if where != "the devices=N hint":  # its torchrun starts the devices=N processes asked for
        assert args is None, f"{where}: a second launch whose module failed started torchrun: {proc.stderr}"


@pytest.mark.skipif(importlib.util.find_spec("torch_tpu") is None, reason="TorchTPU is not installed")
def test_torch_tpu_prints_its_launch_variables_as_the_launch_test_above_has_them():
    # Two host names take the module's multi-host path, which needs no TPU here.
    env = script_env({"TORCH_DEVICE_BACKEND_AUTOLOAD": "1", "TPU_WORKER_HOSTNAMES": "host-a,host-b", "NODE_RANK": "1"})
    for name in (*WORKER_VARS, "WORLD_SIZE", "NNODES", "MASTER_ADDR", "MASTER_PORT", "JOB_COMPLETION_INDEX"):
        env.pop(name, None)
    proc = run_bounded([sys.executable, "-m", "torch.tpu.distributed"], env, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert all(re.fullmatch(r'\w+="?[^"]*"?', line) for line in lines), f"not plain assignments: {lines}"
    assert [line.split("=")[0] for line in lines] == [line.split("=")[0] for line in LAUNCH_ENV["two hosts"].splitlines()]
