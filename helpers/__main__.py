import sys

from .notebook.runner import main

sys.exit(main())
