"""``python -m qcollect.launch``: see `qcollect.launch`."""

import sys

from qcollect.launch import main

if __name__ == "__main__":
    sys.exit(main())
