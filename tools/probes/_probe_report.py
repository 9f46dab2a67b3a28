"""What more than one probe writes the same way: its JSON report, where its command line says.

Not a probe: a probe run as ``python3 tools/probes/NAME.py`` imports it (Python puts the script's
folder first on sys.path).
"""

import json
import sys


def write_report(out):
    """``out`` as indented JSON (what JSON lacks as str) into the path given as the first argument,
    else on stdout."""
    text = json.dumps(out, indent=1, default=str)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)
    else:
        print(text)
