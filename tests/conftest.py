"""Shared fixtures: a small real-text corpus prepared once per session, and tiny configs."""

import os
import sysconfig
from pathlib import Path

import pytest
import torch

# Tests run on 2 cores; more threads than cores makes everything crawl. Under pytest-xdist
# (`make test` runs the unit and adversarial tests in 2 worker processes) each worker gets its
# share of the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
os.environ.setdefault("SLIPSTREAM_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "test"))


def _corpus_text() -> str:
    """~200 KB of real text: a few standard-library modules (always available offline)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / name).read_text(encoding="utf-8") for name in ("textwrap.py", "argparse.py", "shlex.py")]
    return "\n".join(parts)


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(_corpus_text(), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus_file) -> Path:
    from slipstream.data import prepare_dataset

    out = tmp_path_factory.mktemp("prepared") / "byte"
    prepare_dataset([str(corpus_file)], "byte", str(out), val_fraction=0.1, num_workers=1, progress=False)
    return out


@pytest.fixture
def tiny_overrides(tmp_path, data_dir):
    """Overrides for a seconds-long LM run on the prepared corpus, in a fresh run dir."""
    return [
        "--model.preset=tiny", f"--data.dir={data_dir}", f"--run.dir={tmp_path / 'run'}",
        "--train.max_steps=12", "--train.micro_batch_size=4", "--train.seq_len=32",
        "--train.eval_interval=6", "--train.eval_steps=2", "--optim.warmup_steps=3",
        "--logging.log_interval=1", "--logging.progress=false", "--train.deterministic=true",
    ]
