"""Run examples/grpo_single_gpu.py's main() in this process and print its dispatch.history() as JSON.

    usage: python tools/dispatch_history.py [grpo_single_gpu.py arguments ...]

The layout step's proof of "no behaviour change": the same arguments at two commits give the same history (every
op, status and reason, with its count). Exit: the example's own exit code.
"""
import json
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__.strip())
        sys.exit(0)
    example = Path(__file__).resolve().parent.parent / "examples" / "grpo_single_gpu.py"
    namespace = runpy.run_path(str(example), run_name="grpo_single_gpu")
    code = namespace["main"](sys.argv[1:])
    from rlkernel import dispatch

    print("DISPATCH_HISTORY " + json.dumps(dispatch.history_json(), sort_keys=True))
    sys.exit(code)
