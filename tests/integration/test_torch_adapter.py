"""transfer.torch: the same batches as a stock DataLoader, errors and crashes reach the trainer,
and nothing is left behind. Skipped without torch (the `torch` or `examples` extra)."""

from __future__ import annotations

import gc
import os
import re
import signal
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from torch.utils.data import DataLoader, Dataset, IterableDataset  # noqa: E402

import transfer  # noqa: E402
from transfer.torch import SampleSpec, TransferLoader  # noqa: E402

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"


class Images(Dataset):
    """Image-like samples whose bytes say which sample they are."""

    def __init__(self, n: int = 45, shape: tuple[int, ...] = (3, 8, 8)) -> None:
        self.n, self.shape = n, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(int(np.prod(self.shape)), dtype=torch.int32).reshape(self.shape).add(i * 7).to(torch.uint8)


class Pairs(Images):
    """(ndarray features, int label): a tuple sample, collated as a list like default_collate."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.full((5,), i / 3, np.float32), i


class Failing(Images):
    def __init__(self, bad: int, how: str) -> None:
        super().__init__()
        self.bad, self.how = bad, how

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            if self.how == "raise":
                raise KeyError(f"no sample {i} here")
            if self.how == "shape":
                return torch.zeros(3, 9, 9, dtype=torch.uint8)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def _same(got: list, ref: list) -> None:
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        a, b = (a, b) if isinstance(a, list) else ([a], [b])
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def _clone(batch):  # a batch is valid until the next one is asked for: keep copies
    return [t.clone() for t in batch] if isinstance(batch, list) else batch.clone()


@pytest.fixture(scope="module")
def embedded():
    with transfer.serve_in_process(backend="numpy") as d:
        yield d


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["view", "endpoint"])
def test_same_batches_as_dataloader(embedded, workers: int, how: str) -> None:
    target = embedded if how == "view" else embedded.endpoint
    with TransferLoader(Images(), batch_size=8, num_workers=workers, daemon=target) as loader:
        assert loader.mode == ("view" if how == "view" else "copy")
        for _ in range(2):  # two epochs through the same slots
            _same([_clone(b) for b in loader], list(DataLoader(Images(), batch_size=8)))


def test_tuples_shuffle_drop_last(embedded) -> None:
    kw = dict(batch_size=4, shuffle=True, drop_last=True)
    with TransferLoader(Pairs(), num_workers=2, daemon=embedded, generator=torch.Generator().manual_seed(5), **kw) as loader:
        got = [_clone(b) for b in loader]
    _same(got, list(DataLoader(Pairs(), num_workers=0, generator=torch.Generator().manual_seed(5), **kw)))
    assert len(got) == 45 // 4 and got[0][1].dtype == torch.int64


def test_hold_keeps_earlier_batches_intact(embedded) -> None:
    ref = list(DataLoader(Images(), batch_size=4))
    with TransferLoader(Images(), batch_size=4, num_workers=2, daemon=embedded, hold=3) as loader:
        assert loader.slots_count == 2 * 2 + 3
        kept: list = []
        for i, b in enumerate(loader):
            kept = (kept + [b])[-3:]  # the last three are valid together
            for k, old in enumerate(kept):
                assert torch.equal(old, ref[i - len(kept) + 1 + k])


def test_a_batch_kept_past_its_slot_is_an_error_not_silent_garbage(embedded) -> None:
    """`list(loader)` keeps every batch while their slots are reused: that raises, naming the
    fix, instead of returning batches overwritten by later ones; cloned batches are fine, and
    so are the DataLoader's keywords that mean nothing here (pin_memory)."""
    with TransferLoader(Images(), batch_size=4, num_workers=2, daemon=embedded, pin_memory=True) as loader:
        with pytest.raises(RuntimeError, match=r"batch 0 is still referenced 2 batches later.*clone\(\)"):
            list(loader)
        ref = list(DataLoader(Images(), batch_size=4))
        _same([b.clone() for b in loader], ref)
    with pytest.raises(TypeError, match="collate_fn has nowhere to run"):
        TransferLoader(Images(), batch_size=4, daemon=embedded, collate_fn=lambda xs: xs)


def test_refusals(embedded) -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(1)

    with pytest.raises(TypeError, match="map-style"):
        TransferLoader(Stream(), batch_size=2, daemon=embedded)
    with pytest.raises(TypeError, match="dict"):
        SampleSpec.like({"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="no GPU"):
        TransferLoader(Images(), batch_size=2, daemon=embedded, device="cuda")


@pytest.mark.parametrize("how, error, match", [
    ("raise", KeyError, "no sample 13 here"),
    ("shape", ValueError, r"sample 13: \(3, 9, 9\) torch.uint8, but every sample must be \(3, 8, 8\)"),
    # torch names a killed worker one of two ways: its SIGCHLD handler or its queue's watchdog
    ("kill", RuntimeError, "exited unexpectedly|is killed by signal"),
])
def test_worker_failures_reach_the_trainer(embedded, how: str, error: type, match: str) -> None:
    with TransferLoader(Failing(13, how), batch_size=4, num_workers=2, daemon=embedded) as loader:
        with pytest.raises(error, match=match):
            for _ in loader:
                pass
        # The loader survives its failed epoch: a new one starts new workers and slots.
        if how != "kill":
            assert sum(1 for _ in zip(range(2), loader)) == 2


def _ours() -> tuple[int, int]:
    """Our child processes, and transfer memfds mapped in this process."""
    maps = Path("/proc/self/maps").read_text()
    return len(psutil.Process().children(recursive=True)), len(re.findall(r"memfd:transfer\.", maps))


def test_close_leaves_nothing_behind(shm_dir: Path) -> None:
    gc.collect()  # what an earlier test left for the collector (a failed epoch's traceback holds its slots)
    before = _ours()
    threads = threading.active_count()
    children = {p.pid for p in psutil.Process().children()}  # other tests' daemons may be running
    loader = TransferLoader(Images(), batch_size=8, num_workers=2, backend="numpy", daemon_options={"shm_dir": shm_dir}, persistent_workers=True)
    it = iter(loader)
    batch = next(it)
    workers = [p for p in psutil.Process().children() if p.pid not in children]
    assert batch.shape == (8, 3, 8, 8) and len(workers) == 2
    loader.close()
    del it, batch
    gc.collect()
    assert _ours() == before
    assert os.listdir(shm_dir) == []  # the daemon's lock, socket and doorbells went with it
    assert threading.active_count() <= threads  # the embedded daemon's thread is gone too


@pytest.mark.parametrize("backend", ["streamsim", pytest.param("cupy", marks=pytest.mark.gpu)])
def test_device_batches_by_dlpack(backend: str) -> None:
    """device='cuda': the daemon copies each slot into a device buffer; the batch comes by DLPack.
    The simulated GPU's memory is host RAM, so its tensors are CPU tensors; on a real GPU, cuda ones."""
    want = "cuda" if backend == "cupy" else "cpu"
    with transfer.serve_in_process(backend=backend) as d:
        with TransferLoader(Pairs(), batch_size=8, num_workers=2, daemon=d, device="cuda") as loader:
            assert loader.mode == "device"
            got = [_clone(b) for b in loader]
    assert {t.device.type for b in got for t in b} == {want}
    _same([[t.cpu() for t in b] for b in got], list(DataLoader(Pairs(), batch_size=8)))


def test_guide_section_runs() -> None:
    """docs/guide.md's PyTorch blocks (fenced `py`: the core guide test has no torch) run."""
    text = GUIDE.read_text()
    section = text[text.index("## PyTorch") :]
    blocks = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    assert blocks
    ns: dict[str, object] = {}
    for code in blocks:
        exec(compile(code, "guide.md (PyTorch)", "exec"), ns)


def test_bench_runs(tmp_path: Path) -> None:
    """bench/torch_loader.py end to end at a tiny scale: both loaders, equal checksums, the JSON."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[2] / "bench" / "torch_loader.py"
    spec = importlib.util.spec_from_file_location("torch_loader_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    threads = torch.get_num_threads()
    try:
        assert mod.main(["--repeats", "1", "--scale", "0.02", "--warmup", "2", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == set(mod.WORKLOADS)
    for res in doc["results"].values():
        assert set(res["paths"]) == {"stock DataLoader", "TransferLoader"}


def test_core_never_imports_torch_and_the_adapter_names_its_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys, transfer, transfer.cli.transferd\n"
        "assert 'torch' not in sys.modules\n"
        "sys.modules['torch'] = None\n"
        "try:\n    import transfer.torch\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "transfer[torch]" in out
