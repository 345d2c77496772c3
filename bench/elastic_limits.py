"""What another number of processes changes in a `global_window` run (issue 54): the windows hold the same samples on
any number of processes, but dropout masks and random transforms are drawn by each rank, and BatchNorm's running
statistics are kept by each rank. For a float64 MLP with a dropout or BatchNorm layer (each `BatchNormAccumulation`
mode), `fit_one_cycle` over 2 epochs of 96 shuffled samples in windows of 32: the relative distance of the weights and
of the floating-point buffers (the running statistics; not the counts) from the uninterrupted 1-process run's, for the uninterrupted 2-process run and for
a run cut on 2 processes and resumed on 1 (the resume says the same in one line: `elastic.say_what_differs`).

    python bench/elastic_limits.py"""
import sys, tempfile, warnings
from pathlib import Path
warnings.filterwarnings('ignore')
sys.path.insert(0, str(Path(__file__).resolve().parent.parent/'tests'))
sys.path.insert(0, str(Path(__file__).resolve().parent))

def main():
    import torch
    import elastic_worker as W
    from accum_callback.testing import launch_gloo
    from common import machine
    print(machine())
    rel = lambda a, b: ((a - b).norm()/b.norm()).item() if b.numel() and b.norm() > 0 else float((a - b).abs().max()) if b.numel() else float('nan')
    cases = [dict(), dict(layer='dropout'), dict(layer='batchnorm')] + [dict(layer='batchnorm', bn=m) for m in ('pool', 'momentum', 'freeze', 'groupnorm', 'renorm')]
    print(f"{'model':32} {'2 processes: weights':>21} {'buffers':>9} {'2 -> 1 resumed: weights':>24} {'buffers':>9}  said at resume")
    for kw in cases:
        one = W.train(**kw)
        two = launch_gloo(W.train, world=2, kwargs=kw, timeout=300)[0]
        with tempfile.TemporaryDirectory() as d:
            ck = (d, dict(every=1))
            launch_gloo(W.train, world=2, kwargs=dict(kw, ckpt=ck, cut=17), timeout=300)
            res = W.train(ckpt=ck, **kw)
        name = 'MLP' + (f" + {kw['layer']}" if kw.get('layer') else '') + (f" ({kw['bn']!r})" if kw.get('bn') else '')
        said = '; '.join(s.split(': ', 2)[-1][:60] for s in res['said']) or '-'
        f = lambda x: 'n/a' if x != x else f'{x:.1e}'
        print(f"{name:32} {f(rel(two['params'], one['params'])):>21} {f(rel(two['buffers'], one['buffers'])):>9} "
              f"{f(rel(res['params'], one['params'])):>24} {f(rel(res['buffers'], one['buffers'])):>9}  {said}", flush=True)

if __name__ == '__main__': main()
