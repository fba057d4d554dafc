import sys

from benchmarks.peers.bench import main

sys.exit(main())
