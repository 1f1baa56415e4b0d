"""The shipped scorers pinned: every scorer folder under baby/scorers and codebaby/scorers gives,
on a fixed short sequence, the priorities recorded in tests/scorer_pins.json (fp64), and a code
scorer the held-out KL of two files at 0.125 as bench.py quality --task code computes it (fp32),
to 1e-6 (tests/pin_scorers.py computes both). A change to the code a shipped scorer runs (its
features, a[t], its reads, its read-out) fails here even where all its forms still agree.

When a scorer is retrained or a new one ships, its pins are re-recorded, and committed with it:

python -m tests.pin_scorers
"""

import json

import pytest
import torch

from tests import pin_scorers

with open(pin_scorers.PINS) as f:
    PINS = json.load(f)
FOLDERS = pin_scorers.shipped()
CODE = [d for d in FOLDERS if pin_scorers.model_of(d) == "codebaby"]
AGAIN = "retrained or added? re-run python -m tests.pin_scorers and commit tests/scorer_pins.json"


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # small ops: on a busy 2-core machine a second thread mostly waits
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_every_shipped_scorer_is_pinned():
    assert sorted(PINS) == FOLDERS, AGAIN
    assert len(FOLDERS) >= 24 and len(CODE) == 2


def pinned(folder):  # the folder's pins, once its tensors are the ones pinned
    assert folder in PINS, f"{folder} is not pinned: {AGAIN}"
    pin = PINS[folder]
    changed = f"{folder}/scorer.safetensors changed: {AGAIN}"
    assert pin_scorers.digest(folder) == pin["digest"], changed
    return pin


@pytest.mark.parametrize("folder", FOLDERS)
def test_shipped_scorer_gives_its_pinned_priorities(folder):
    pin = pinned(folder)
    got = pin_scorers.priorities(folder)
    want = got.new_tensor(pin["priorities"])  # (L, H, T)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-6


@pytest.mark.parametrize("folder", CODE)
def test_code_scorer_gives_its_pinned_held_out_kl(folder):
    pin = pinned(folder)
    other = "the held-out files are not the pinned ones (another torch than requirements.txt's?)"
    assert pin_scorers.files_digest() == pin["files"], other
    assert abs(pin_scorers.code_kl(folder) - pin["kl"]) <= 1e-6
