"Smoke test of `bench/bench.py`: `--quick` prints the whole table (every row, no errors); no timing is asserted"
import importlib.util, subprocess, sys
from pathlib import Path

import pytest, torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT/'bench'/'bench.py'
from accum_callback.batchnorm.modes import BN_MODES

def load_bench():
    spec = importlib.util.spec_from_file_location('bench_script', SCRIPT)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

def table_rows(md):
    "The cells of every body row of the markdown table"
    lines = [l for l in md.splitlines() if l.startswith('| ')][1:]   # drop the header
    return [[c.strip() for c in l.strip('|').split(' | ')] for l in lines]

@pytest.fixture(scope='module')
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench')/'bench.md'
    res = subprocess.run([sys.executable, str(SCRIPT), '--quick', '--out', str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, out.read_text()

def test_quick_prints_every_row(quick):
    stdout,written = quick
    assert '| measure | ratio | goal | met? |' in stdout
    rows = table_rows(stdout)
    assert all(len(r) == 4 for r in rows), rows
    expected = ['time/epoch: ours / fastai `GradientAccumulation(n_acc=16)`', 'time/epoch: ours / hand-written PyTorch loop',
                'memory: micro-batch 4 x 4 / batch 16', 'memory: micro-batch 4 x 4 / batch 4 alone',
                *[f"time/epoch: `BatchNormAccumulation('{m}')` / plain accumulation" for m in BN_MODES],
                *[f"ops/micro-batch added by `BatchNormAccumulation('{m}')`, resnet18" for m in BN_MODES],
                'DDP all-reduce rounds/epoch', 'DDP time/epoch', 'CUDA']
    if torch.cuda.is_available(): expected = expected[:-1] + ['CUDA']*(6 + len(BN_MODES))
    names = [r[0] for r in rows]
    for e in expected: assert sum(n.startswith(e) for n in names) >= 1, f'no row {e!r} in {names}'
    assert len(rows) == len(expected), names
    for name,ratio,goal,met in rows:
        assert 'error' not in ratio, (name, ratio)
        # (--quick's tiny fit may not move a loaded machine's memory peak at all: 'not measurable' says so, no verdict)
        if name.startswith('memory') and ratio.startswith('not measurable'): assert met == '—'; continue
        if not name.startswith('CUDA') and ratio != 'info' and goal != 'info': assert met in ('yes', 'no', 'within noise'), (name, met)
    # the all-reduce count is exact, not timing: one round per window instead of one per micro-batch
    assert next(r for r in rows if r[0].startswith('DDP all-reduce'))[3] == 'yes'
    assert ('skipped: no CUDA device' in stdout) != __import__('torch').cuda.is_available()
    for line in ('- machine: ', '- command: `python bench/bench.py --quick --out ', '- memory: ', 'torch '):
        assert line in stdout, line
    assert written.strip() == stdout.strip()

def test_cuda_path_runs_on_cpu():
    "The CUDA section's code path, on the CPU with tiny sizes: every contender runs, memory is n/a, rows have 4 cells"
    b = load_bench()
    rows,raw = b.cuda_section('cpu', arch='resnet18', px=32, b=2, k=2, windows=1, repeats=1, warmup=False)
    assert len(rows) == 6 + len(BN_MODES) and all(len(r) == 4 for r in rows)
    assert not any('error' in r[1] for r in rows), rows
    assert rows[3][1] == 'n/a (not a CUDA device)'
    assert set(raw) == {'ours', 'fastai', 'big', 'hand', 'native_gn', *BN_MODES} and all(v[0] > 0 for v in raw.values())

def test_table_cells_stay_in_their_column():
    "An error text with a newline or a pipe (what broke a row on a CUDA machine) stays one cell"
    md = load_bench().table([['m', 'error: RuntimeError: CUDA out of memory.\nTried | to', '<= 1', '—']])
    assert all(len(r) == 4 for r in table_rows(md))

def test_verdict_and_ratio():
    b = load_bench()
    assert b.verdict(0.99, 0.01, 1.0) == 'yes' and b.verdict(1.005, 0.01, 1.0) == 'within noise'
    assert b.verdict(1.2, 0.01, 1.0) == 'no' and b.verdict(None, 0, 1.0) == '—'
    row = b.time_row('m', [1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 1.0)
    assert row == ['m', '1.000 ± 0.000', '<= 1.00', 'yes']

def test_pool_and_momentum_ops_do_not_grow_with_batchnorm_layers():
    """Exact op counts, not timing: 'pool' adds at most 24 compute ops per micro-batch on resnet50 (53 BatchNorm
    layers) and resnet18 (20) within 4 of it; 'momentum' adds none (whole fits, micro-batch 2 x 4, 2 windows)"""
    b = load_bench()
    c = {a: b.op_counts(a, px=16, b=2, k=4, windows=2, modes=('pool', 'momentum')) for a in ('resnet18', 'resnet50')}
    assert c['resnet50']['pool'] <= 24 and abs(c['resnet50']['pool'] - c['resnet18']['pool']) <= 4, c
    assert c['resnet50']['momentum'] == c['resnet18']['momentum'] == 0, c

def test_auto_micro_bs_script_runs_on_cpu():
    "bench/auto_micro_bs.py's code path on the CPU (tiny sizes, no cap: nothing runs out of memory, figures mean nothing)"
    res = subprocess.run([sys.executable, str(ROOT/'bench'/'auto_micro_bs.py'), '--device', 'cpu', '--arch', 'resnet18',
                          '--px', '16', '--bs', '16', '--batches', '2'], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "micro_bs='auto': size found" in res.stdout and "/ best fixed micro_bs (" in res.stdout and 'escaped' not in res.stdout

def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT/'bench'/f'{name}.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

def test_loader_bench_runs_and_its_gpu_comparison_runs_on_cpu(tmp_path, monkeypatch):
    """bench/loader_bench.py's code paths at tiny sizes (figures mean nothing here): the loader rows, and the GPU
    comparison (the job from the cache against the model on device-resident batches) run on the CPU"""
    monkeypatch.setenv('ACCUM_CALLBACK_CACHE', str(tmp_path/'cache'))
    lb = _load('loader_bench')
    data = lb.make_jpegs(tmp_path/'jpegs', 40, n_cls=2, lo=40, hi=60)
    res = subprocess.run([sys.executable, str(ROOT/'bench'/'loader_bench.py'), '--data', str(data), '--size', '32', '--bs', '4',
                          '--device', 'cpu'], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loader alone, images/s: fastai's pipeline" in res.stdout and 'the cache built in' in res.stdout
    r = lb.gpu_bound(data, tmp_path/'c2', 'cpu', arch='resnet18', size=32, mb=4, k=2, precision='fp32', windows=1)
    assert r['job'] > 0 and r['model'] > 0 and r['ratio'] > 0

def test_noise_cost_runs():
    res = subprocess.run([sys.executable, str(ROOT/'bench'/'noise_cost.py'), '--rounds', '1', '--windows', '2'], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'measured / plain time:' in res.stdout and 'inside the callback:' in res.stdout

def test_precise_cost_runs():
    "bench/precise_cost.py's code path at tiny sizes (figures mean nothing here)"
    res = subprocess.run([sys.executable, str(ROOT/'bench'/'precise_cost.py'), '--rounds', '1', '--windows', '1', '--items', '16'],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'recomputation / training epoch:' in res.stdout
