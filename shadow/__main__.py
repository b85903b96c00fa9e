import sys

from shadow.cli.main import main

sys.exit(main())
