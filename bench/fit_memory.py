"""Peak memory of a plain `fit` with `GradientAccumulation` (no sharding anywhere), each in a fresh process: as the library
runs it now, against the same fit with torch's FSDP package imported first, which is what every fit did before 0.2.0
(the sharding checks imported it). Alternating rounds; the medians and their difference.

    python bench/fit_memory.py --rounds 5"""
import argparse, json, statistics, subprocess, sys

FIT = r'''
import json, resource, sys
if sys.argv[1] == 'fsdp_loaded': import torch.distributed.fsdp   # what the sharding checks did at every fit before
import torch, torch.nn as nn
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from accum_callback import GradientAccumulation
x, y = torch.randn(256, 20), torch.randint(0, 3, (256,))
dls = DataLoaders.from_dsets(list(zip(x[:200], y[:200])), list(zip(x[200:], y[200:])), bs=8, device='cpu')
learn = Learner(dls, nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3)), loss_func=nn.CrossEntropyLoss(),
                cbs=GradientAccumulation(n_step=4))
with learn.no_bar(), learn.no_logging(): learn.fit(1)
print(json.dumps(dict(peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024,
                      fsdp='torch.distributed.fsdp' in sys.modules, dtensor='torch.distributed.tensor' in sys.modules)))
'''

def run(variant:str)->dict:
    res = subprocess.run([sys.executable, '-W', 'ignore', '-c', FIT, variant], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--rounds', type=int, default=5)
    a = p.parse_args(argv)
    got = {'now': [], 'fsdp_loaded': []}
    for _ in range(a.rounds):
        for k in got: got[k].append(run(k))
    now,before = (statistics.median(r['peak_mib'] for r in got[k]) for k in ('now', 'fsdp_loaded'))
    print(f"peak RSS of a plain fit: {now:.0f} MiB now (FSDP package loaded: {got['now'][0]['fsdp']}), "
          f"{before:.0f} MiB with it loaded as before ({before-now:+.0f} MiB), medians of {a.rounds} fresh processes each")
    return got

if __name__ == '__main__': main()
