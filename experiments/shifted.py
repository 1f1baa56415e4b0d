"""kvpop-shifted (delayed, ours): a research variant of the paper's mLSTM, registered the README's way (Add a scorer)
by importing this module, with its fast decoding form. Train it: python -m experiments.shifted --task cue (train.py's
flags, --kind kvpop-shifted preset)."""

import runpy
import sys

import torch
from torch.nn.functional import pad

import fast
import kvpop


class ShiftedMemoryScorer(kvpop.MemoryScorer):
    """kvpop with one change: each token is written under its predecessor's key, k'_j = W_k x[j - 1] / sqrt(d_m)
    (zeros for token 0), its value and gates still its own. Token t + 1 is then written under t's own features, so
    what came right after t (cue's `no`) is a match of t's read with itself (README, Method: scorers)."""

    kind = "kvpop-shifted"

    def build(self):
        super().build()
        if self.window < 2:
            raise ValueError("kvpop-shifted decodes with the token before the newest in the window: use window >= 2")

    # x[j - 1] for each token j of features x (B, H, T, X); zeros before token 0
    def written_under(self, x):
        return pad(x, (0, 0, 1, 0))[..., :-1, :]


class ShiftedFoldedMemory(fast.FoldedMemory):
    """kvpop-shifted's fast decoding, kvpop's: the memories take token p - 1 under token p - 2's key, both still in
    the window (w >= 2)."""

    def write(self, p, take):
        z = self.project(*self.cache.recent_kv(p - 1))
        before = self.project(*self.cache.recent_kv(p - 2))
        key = before[..., : self.scorer.d_mem]
        key = torch.where(p >= 2, key, 0.0)  # token 0's predecessor: none
        self.remember(z, key, take)


kvpop.SCORERS["kvpop-shifted"] = ShiftedMemoryScorer
fast.FAST[ShiftedMemoryScorer] = ShiftedFoldedMemory
fast.WHOLE[ShiftedMemoryScorer] = fast.chunked_parallel

if __name__ == "__main__":
    sys.argv = ["train.py", "--kind", "kvpop-shifted", *sys.argv[1:]]
    runpy.run_path("train.py", run_name="__main__")
