"""The fairseq plugin: the only code that imports or patches fairseq.

Owns oss_adam's registration and config (:mod:`.optimizer`), the model wrapper that
leaves the gradients' reduction to oss_adam (:mod:`.grad_sync`), ``--amp`` on the
shards it leaves (:mod:`.amp`) and ``--fp16``'s master copy sharded (:mod:`.fp16`), the
CPU launch fixes
(:mod:`.compat`), and fairseq's save path (:mod:`.save_path`, with the ``--keep-*``
rules of asynchronous saves, :mod:`.pruning`), load path (:mod:`.load_path`) and
launcher (:mod:`.launcher`, which stops fairseq's background batch threads as a rank's
training ends, :mod:`.data_threads`), each patch installed once (:mod:`.patching`) and,
apart from the CPU launch fixes and that stop (any optimizer), doing nothing unless the
trainer trains with oss_adam. It calls :mod:`fairseq_oss.checkpoint`
and :mod:`fairseq_oss.optim`; neither of them calls back.

Importing this package installs the plugin; :func:`fairseq_oss.register` does that.
Each module applies its own patches when it is imported, so that the plugin is whole
also when one of them is what imported fairseq (the registration hook then fires while
that module is half-imported, and the module finishes the job itself).
"""
from fairseq_oss.integration import compat  # noqa: F401 - first: the launcher wraps its fixes
from fairseq_oss.integration import grad_sync  # noqa: F401 - the model wrapper of the reduce-scatter
from fairseq_oss.integration import optimizer  # noqa: F401 - registers --optimizer oss_adam
from fairseq_oss.integration import amp  # noqa: F401 - fairseq's --amp on the reduced shards
from fairseq_oss.integration import fp16  # noqa: F401 - fairseq's --fp16 master copy, sharded
from fairseq_oss.integration import save_path  # noqa: F401
from fairseq_oss.integration import load_path  # noqa: F401
from fairseq_oss.integration import launcher  # noqa: F401
