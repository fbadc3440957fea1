"""Every page's shell commands, one after another in one directory, as a reader working through
README and the site's pages runs them (see test_docs.py for how a command is run or checked).
A module of its own: the longest test of the suite, so that pytest-xdist (``--dist loadscope``,
a module per worker) can run test_docs.py's pages on the other worker meanwhile."""

from __future__ import annotations

from test_docs import _session_dir, reading_order, run_step, shell_steps


def test_the_pages_shell_commands_run_one_after_another_in_one_directory(tmp_path):
    """A reader works through README and the site's pages in one checkout: every command runs
    where the ones before it ran, finding what they left (run directories, packed data)."""
    work = _session_dir(tmp_path)
    report = []
    for page in reading_order():
        for block, command in shell_steps(page):
            report.append(run_step(block, command, work))
    print("\n".join(report))
