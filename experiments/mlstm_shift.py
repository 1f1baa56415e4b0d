"""The paper's mLSTM writing each token under its predecessor's key, k'_j = W_k x[j - 1] (v'_j and the gates still
from x[j]): at read t, the token after t is written under t's own features, so "the word after t" becomes a match of
t with itself. Patches the parallel form only (training, the masked pass; no decoding), then runs a script:

python experiments/mlstm_shift.py train.py --task cue --kind kvpop --p_cue_min 0.17 --p_cue_max 0.17 --out_dir DIR
python experiments/mlstm_shift.py bench.py quality --task cue --policies full --scorer DIR
"""

import inspect
import os
import runpy
import sys
import textwrap

here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, here)
import kvpop

# MemoryScorer.chunked with its memory keys made from the previous token's features
chunks = "        chunks = x.split(self.chunk, -2)\n"
shifted = "        previous = pad(x, (0, 0, 1, 0))[..., :-1, :]  # x[j - 1], zeros before token 0\n"
src = textwrap.dedent(inspect.getsource(kvpop.MemoryScorer.chunked).replace(chunks, chunks + shifted))
src = src.replace("k = part @ self.wk[layer]", "k = previous[..., start:end, :] @ self.wk[layer]")
assert "previous[..., start:end, :]" in src and "previous = pad" in src
space = {}
exec(src, vars(kvpop), space)
kvpop.MemoryScorer.chunked = space["chunked"]
sys.argv = sys.argv[1:]
runpy.run_path(os.path.join(here, sys.argv[0]), run_name="__main__")
