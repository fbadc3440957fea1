"""Run a page's Python code blocks in order, in one namespace, as a reader pasting them would.

Usage: python doc_session.py BLOCKS.json   (a list of {"line": N, "code": "..."}; cwd is the session's)
Prints ``BLOCK <line> OK`` after each; a failing block prints its traceback and ``BLOCK <line>
FAILED`` and the session stops with exit status 1.
"""

import json
import sys
import traceback


def main() -> int:
    blocks = json.loads(open(sys.argv[1]).read())
    namespace: dict = {"__name__": "__main__"}
    for block in blocks:
        try:
            exec(compile(block["code"], f"<{block['page']} line {block['line']}>", "exec"), namespace)
        except BaseException:  # noqa: BLE001 - report any failure of the block, SystemExit included
            traceback.print_exc()
            print(f"BLOCK {block['line']} FAILED", flush=True)
            return 1
        print(f"BLOCK {block['line']} OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
