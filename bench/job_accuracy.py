"""The job's accuracy at its defaults over seeds and CPU kernel settings: `python -m accum_callback --seed S` run in a
fresh process for each seed under each `ATEN_CPU_CAPABILITY` (`unset`: torch's pick for this CPU; `default`: its
scalar kernels; `avx2`, `avx512` where the CPU has them), from the shipped pretrained checkpoint. Prints each run's
accuracy and the range over all of them: the README's range is this one.

    python bench/job_accuracy.py [--seeds 5] [--settings unset default avx2]"""
import argparse, json, os, subprocess, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def cpu_flags()->set:
    try: return set(next(l for l in open('/proc/cpuinfo') if l.startswith('flags')).split(':')[1].split())
    except (OSError, StopIteration): return set()

def run(seed:int, setting:str, out:Path)->float:
    env = {k: v for k,v in os.environ.items() if k != 'ATEN_CPU_CAPABILITY'}
    if setting != 'unset': env['ATEN_CPU_CAPABILITY'] = setting
    cmd = [sys.executable, '-m', 'accum_callback', '--seed', str(seed), '--device', 'cpu', '--out', str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode: sys.exit(f'seed {seed}, {setting}: exit {r.returncode}\n{r.stderr[-2000:]}')
    if 'pretraining' in r.stderr: sys.exit('the job pretrained: the shipped checkpoint was not used')
    return json.loads((out/'metrics.json').read_text())['accuracy']

if __name__ == '__main__':
    flags = cpu_flags()
    here = ['unset', 'default'] + (['avx2'] if 'avx2' in flags else []) + (['avx512'] if 'avx512f' in flags else [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--seeds', type=int, default=5); p.add_argument('--settings', nargs='+', default=here)
    a = p.parse_args()
    import torch   # (the version, for the record)
    kind = 'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'neither AVX2 nor AVX-512'
    print(f"torch {torch.__version__}, CPU: {kind}")
    accs = []
    with tempfile.TemporaryDirectory() as d:
        for setting in a.settings:
            row = [run(s, setting, Path(d)/f'{setting}-{s}') for s in range(a.seeds)]
            accs += row
            shown = ', '.join(f'{x:.4f}' for x in row)
            print(f"ATEN_CPU_CAPABILITY={setting:8s} seeds 0-{a.seeds-1}: {shown}", flush=True)
    print(f"range over {len(accs)} runs: {min(accs):.4f}-{max(accs):.4f} (mean {sum(accs)/len(accs):.4f})")
