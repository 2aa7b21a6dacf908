"""``python -m fairseq_oss``: the ``fairseq-oss`` checkpoint tools."""
import sys

from fairseq_oss.tools import main

sys.exit(main())
