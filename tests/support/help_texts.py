"""Print each named script's own --help text, as JSON {script: text}, from one process.

tests/test_docs.py checks every documented flag against the script's --help. One `python script --help` a
script costs an `import torch` each (about 2 s, some two dozen scripts); here torch is imported once and each script
runs as __main__ (runpy), as `python script --help` runs it, until argparse prints its help and exits. The name
torchrun asks torchrun's own parser (its console script's main), which saves another process."""
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

texts = {}
for script in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [script, "--help"]
    with contextlib.redirect_stdout(out):
        try:
            if script == "torchrun":
                sys.argv[0] = "torchrun"
                from torch.distributed.run import main
                main()
            else:
                runpy.run_path(str(REPO / script), run_name="__main__")
        except SystemExit:
            pass
        except Exception:  # noqa: BLE001  the test asks this script on its own, and sees why
            out = io.StringIO()
    texts[script] = out.getvalue()
print(json.dumps(texts))
