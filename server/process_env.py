"""The process environment tierserve reads outside its settings (kernels, caches, workers): named
here once, for the configuration reference and for the misspelt-variable warning."""

from __future__ import annotations

PROCESS_ENV = {
    "OMP_WAIT_POLICY": "`tierserve` sets `PASSIVE` at start-up unless it is already set: on a busy "
                       "box torch's spinning OpenMP threads make it several times slower.",
    "TIERSERVE_CACHE": "Cache root (default `~/.cache/tierserve`): the native extension's build, "
                       "the backend profile, and the disk tier's folder when "
                       "`disk_tier_dir` is unset (`$TIERSERVE_CACHE/kv`).",
    "TIERSERVE_NATIVE": "`0` builds and loads no native extension: attention runs on torch SDPA "
                        "and every op stays in torch.",
    "TIERSERVE_NATIVE_OPS": "`0` keeps the linear layers (oneDNN) and element-wise ops in torch "
                            "instead of the native extension.",
    "TIERSERVE_NATIVE_MARCH": "The x86 level the native extension is built for (gcc's -march; "
                              "default native: this CPU). haswell builds the AVX2 path on an "
                              "AVX-512 box, for tests.",
    "TIERSERVE_SPIN_US": "How long the native extension's workers stay awake between parallel "
                         "loops, in microseconds (default 100; `0` sleeps at once).",
    "TIERSERVE_TP_AUTHKEY": "Internal: the key a tensor-parallel worker process uses to connect "
                            "back to the server that started it (set by the server for its "
                            "workers, removed from their environment once read; never set it).",
    "TIERSERVE_STACK_DECODE_MIN_BATCH": "Smallest decode batch that runs all layers in one "
                                        "native call (default 1; `0` runs every step layer by "
                                        "layer; the results are the same to the bit).",
}
"""Variable -> what it does. tests/test_docs.py checks that every TIERSERVE_* name in the code is
either here or a setting's variable, and that each one here is still read."""
