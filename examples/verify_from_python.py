"""Verify your own model from Python: ``distaccum.verify.verify`` on the components of ``own_loop.py``.

    cd examples && python verify_from_python.py [RUN_DIR]

The candidates run on worker processes started by distaccum's launcher, so the components are given
as ``_target_`` nodes of importable callables (here ``own_loop``'s, importable from this directory);
the single-process reference runs in this process. Exit code 0 when every split matches.
"""

import sys

from distaccum.verify import verify

config = {
    "model": {"_target_": "own_loop.make_model", "vocab": 50, "width": 32},
    "data": {
        "dataset": {"_target_": "own_loop.Sentences", "size": 96},
        "collate": {"_target_": "own_loop.collate", "_partial_": True},
    },
    "loss": {"_target_": "own_loop.loss_sum", "_partial_": True},
    "accum": {"micro_batch": 4, "global_batch": 32},
    "optim": {"lr": 1e-2},
    "precision": "fp64",
    "trainer": {"nproc": 2, "max_steps": 4},
    "run_dir": sys.argv[1] if len(sys.argv) > 1 else "runs/verify_from_python",
}

if __name__ == "__main__":
    result = verify(config, splits=["w2-m4-k4", "w2-m16-k1", "w1-m8-k4"], echo=lambda line: None)
    for row in result.rows:
        print(
            f"{row.run.split.label():<10} {'PASS' if row.passed else 'FAIL'}  max_rel_diff {row.report.max_rel_diff:.1e}"
            f"  loss_diff {row.report.max_loss_diff:.1e}  {[f.cause for f in row.findings]}"
        )
    print(f"passed: {result.passed} -> {result.root / 'verify.json'}")
    sys.exit(result.exit_code)
