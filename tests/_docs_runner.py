"""Runs the python blocks of one docs page in one interpreter (run by path by test_docs.py).

Reads one JSON object per line on stdin, ``{"path": ..., "line": ..., "code": ...}``, executes
the code in a namespace shared by every block of the page (as a reader pasting the blocks one
after another would), and answers on the file descriptor given as argv[1] with one JSON line,
``{"ok": true}`` or ``{"ok": false, "error": <traceback>}``. The code is compiled under the
page's name and line numbers, so a traceback points into the markdown file.
"""

import json
import os
import sys
import traceback


def main() -> None:
    status = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    namespace: dict = {"__name__": "__main__"}
    for line in sys.stdin:
        block = json.loads(line)
        source = "\n" * (block["line"] - 1) + block["code"]
        try:
            exec(compile(source, block["path"], "exec"), namespace)
            reply = {"ok": True}
        except BaseException:  # reported to the test, which fails with it
            reply = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        status.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
