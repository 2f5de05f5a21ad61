"""``make gpu-check``: every CUDA path of rlcore on this machine's GPU, in one command.

On a machine whose torch sees no CUDA device this prints one line and exits 0. Otherwise, with the
Python that runs it (the machine's own, holding its CUDA torch: nothing here installs torch):

1. installs wheels from ``--wheels DIR`` (``WHEELS=DIR`` for make): Ray, megatron-core, pydantic,
   ... Halves of a wheel split to fit a transfer limit (``NAME.whl.part-aa``, ``-ab``, ...) are
   joined first. No index is contacted (``--no-index``), a wheel never replaces a newer installed
   version, and the machine's torch / triton / nvidia-* packages are never touched;
2. installs rlcore and every plugin under ``plugins/`` from this checkout
   (``pip install --no-deps --no-build-isolation --no-index -e``); if that is impossible (no
   setuptools), puts their sources and entry-point metadata on ``PYTHONPATH`` instead;
3. reports every import rlcore needs and what is missing (a missing optional piece - Ray,
   megatron-core - is named, and the tests that need it skip with that reason);
4. runs every ``gpu``-marked test (files under ``tests/`` and ``plugins/*/tests/`` that use the
   marker), with a per-test timeout when pytest-timeout is there;
5. runs ``benchmarks/gpu.py`` in the time that is left;
6. writes ``summary.json`` and ``summary.md`` (a table to paste into ``benchmarks/README.md``) and
   the logs under ``--out`` (default ``runs/gpu-check``).

The whole run is held to ``--budget-s`` (default 540 s, inside 10 minutes). Exit status: 0 when
every check ran and passed; 1 when a test or the benchmark failed; 2 when setup failed; 3 when
everything that ran passed but a piece was missing (e.g. no megatron-core wheel given).

Wheels a GPU machine without network needs (the 'cuda' image has torch, transformers,
safetensors, numpy, pytest, pluggy, typer, pyyaml, tqdm, click, requests, protobuf, msgpack,
filelock, packaging, psutil, setuptools but not these), fetched on a machine with pip::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \\
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 -d .whl \\
        ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \\
        rpds-py==2026.9.1 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \\
        typing-inspection==0.4.5 typing-extensions==4.16.0 megatron-core==0.16.1
    # A wheel over a transfer's size limit (Ray's, ~79 MB) can travel in halves; they are joined here:
    for w in .whl/ray-*.whl; do split -b 40M "$w" "$w.part-" && rm "$w"; done   # -> NAME.whl.part-aa, -ab

then ``make gpu-check WHEELS=.whl`` (or ``python3 scripts/gpu_check --wheels .whl --out DIR``).

The steps, one module each: ``cuda`` (is there a GPU), ``wheels`` (which wheel files to install),
``install`` (wheels, checkout, import check), ``run`` (pytest and the benchmark under the budget),
``report`` (reading their output back, ``summary.json`` and ``summary.md``); ``__main__`` runs them
in order (``python3 scripts/gpu_check``, the folder).
"""
