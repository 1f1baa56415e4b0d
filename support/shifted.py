"""kvpop-shifted (delayed, ours): a research variant of the paper's mLSTM, registered the README's way (Add a scorer).
Its decoding form is support/fast.py's, kvpop's with the key of the token before."""

from torch.nn.functional import pad

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


kvpop.SCORERS["kvpop-shifted"] = ShiftedMemoryScorer
