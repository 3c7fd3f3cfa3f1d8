"""The one-call GPU validation and performance baseline of kvcore (issue 9).

Run on a machine with a CUDA GPU, from the root of the checkout::

    PYTHONUNBUFFERED=1 python -m benchmarks.gpu_suite --out $OUT --budget-s 480

Steps, in order; each is timed, recorded and written to ``<out>/results.json`` (and rendered
to ``<out>/results.md``) as soon as it ends, and an error in one is recorded and the next one
runs. Every figure is measured next to its baseline in the same run; numbers are medians of
repeats with warm-up excluded.

``pytest``   the ``gpu``-marked tests (subprocess, time-limited): pass/fail counts.
``vmm``      (a) per-operation cost of create / map / set-access / unmap / release at 2 MiB
             and larger handle sizes: kvcore's ``cuda`` backend vs raw ``cuda.bindings``
             calls, interleaved. Goal: kvcore <= 1.1x raw.
``mapper``   (a) mapping and unmapping one page id through ``LocalPageMapper`` vs the raw
             create + map + set-access (unmap + release) of the same handles.
``bandwidth`` (b) paged-KV read bandwidth: a Triton gather over a shuffled block table
             (``kernels.py``) on kvcore views (per-layer and compound layouts) vs
             plain ``torch.empty`` tensors of the same shape; decides the default layout on
             CUDA by the rule "default layout >= 0.97x plain".
``handoff``  (c) two processes sharing a per-GPU ledger (private directory): A frees 10 GiB
             of KV, B, polling its allocator, then maps 10 GiB and writes it; time from A's
             free call until B's write is done, per handle size. Goal: <= 50 ms.
``decode``   (d) a decode-batch allocation loop (``BlockLedger`` + ``PageAllocator``) with
             and without the reserve vs a static free list: driver calls on the allocating
             thread and step-time overhead.
``channel``  ``benchmarks/channel_latency.py --backend cuda`` if that script exists.

``--dry-run`` runs the same control flow on the ``host`` backend with tiny sizes, without
Triton or raw CUDA (CPU machines, CI); ``--quick`` shrinks the GPU sizes; ``--only`` /
``--skip`` pick steps. ``python -m benchmarks.render_results`` turns the JSON into the
tables of ``docs/benchmarks.md``.

One module per step (``gpu_tests`` runs the ``pytest`` step), what they share in
``common``, the command line in ``__main__``.
"""
