"""``python -m wide_moe_triton.tune`` (``wide-moe-tune``): sweep every kernel's launch
configs on this GPU and write ``<GPU name>.json`` in the user's tables' directory
(``tuning.user_dir``), which the layer searches before the shipped tables.

For each kernel, dims (TP rank-local shapes of Kimi-K3) and batch-width bucket it runs
each candidate through the kernel's own launch wrapper, checks the output against the
reference (a wrong config is never chosen), times it (``do_bench_cudagraph`` median) and
keeps the fastest. Keys that set a kernel's reduction order (``REDUCTION_KEYS``) are one
choice per shape for every bucket, so tuning never makes a token's bits depend on its
batch width: the choice that minimises the worst slowdown over the swept buckets
(``choose_reduction``); the other keys are then tuned per bucket. The dense linears
that run on the front GEMM (the shared expert's ``shared_gate_up`` and ``shared_down``,
the tail's ``latent_up``) are tuned as kernels of their own, each at its own shapes.

Every candidate of a TP shape is compiled first, in a thread pool (Triton's
``AsyncCompileMode``; the route kernel alone takes 10-25 s a config to compile), then
checked and timed one at a time. Progress goes to a ``.partial.json`` file beside the
output after every kernel: an interrupted sweep resumes where it was; ``--time-limit``
stops starting kernels after that many seconds and writes the table of what is done.
Each point's choice is made at the end, by ``final_ranking``: the sweep's fastest
configs and the default timed again in interleaved rounds, the least median wins.
Beside the table, ``<table>.md``: the tuned config against the default at every point,
their medians of those rounds.

    python -m wide_moe_triton.tune --quick --tp 8 16 1    # buckets 64, 256, 512, 1024
    python -m wide_moe_triton.tune --tp 8 16 1 --batches 1 16 64 128 256 512 1024
"""

# The names the tests, the benchmarks and the layer's modules use, from the module of each
# concern: kernel_cases (what is tuned), search (which configs are tried), engine (the
# sweep, its timing and resume), table (what it writes), command (the command line).
# These are copies of the names: a test that replaces one replaces it in its own module
# (``tune.engine.time_config``), where the sweep looks it up.
from .command import DESCRIPTION, main, parser
from .engine import (BUCKETS, FINALISTS, QUICK_BUCKETS, QUICK_KERNEL_BUDGET, QUICK_REP_MS,
                     REP_MS, ROUNDS, Group, compile_all, compile_only, final_ranking, sweep,
                     time_config)
from .kernel_cases import (FRONT_PAIR_KEYS, FRONT_PRIORS, KERNELS, QUICK_LINEAR, Case, cases,
                           linear_cases, poison, random_expert_weights)
from .search import (QUICK_REDUCTIONS, QUICK_SPLIT_FACTORS, candidates, choose_reduction,
                     neighbours, reduction_options, reduction_trials)
from .table import changed_keys, gains_report, read_json, write_table

__all__ = ['DESCRIPTION', 'main', 'parser', 'BUCKETS', 'FINALISTS', 'QUICK_BUCKETS',
           'QUICK_KERNEL_BUDGET', 'QUICK_REP_MS', 'REP_MS', 'ROUNDS', 'Group',
           'compile_all', 'compile_only', 'final_ranking', 'sweep', 'time_config',
           'FRONT_PAIR_KEYS', 'FRONT_PRIORS', 'KERNELS', 'QUICK_LINEAR', 'Case', 'cases',
           'linear_cases', 'poison', 'random_expert_weights', 'QUICK_REDUCTIONS',
           'QUICK_SPLIT_FACTORS', 'candidates', 'choose_reduction', 'neighbours',
           'reduction_options', 'reduction_trials', 'changed_keys', 'gains_report',
           'read_json', 'write_table']
