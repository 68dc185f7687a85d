import sys

from hybridrec.cli import main

sys.exit(main())
