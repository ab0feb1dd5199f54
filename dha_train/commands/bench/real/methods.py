"""The stages of `bench real`, described per method and budget: which conversion, which training stages after it,
with which settings, and which rows they give."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dha_train import families
from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.algorithms.kv_head_transfer import KVHeadTransfer
from dha_train.bench_runner import StageRunner, model_config, say
from dha_train.bench_settings import MOH_ACTIVE, budget_fraction, budget_heads, moh_setting
from dha_train.conversion.align import TARGET_MAP_FILE, AlignSettings, run_align
from dha_train.conversion.deepseek import DeepseekSettings, convert_to_deepseek
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.conversion.mla import MlaSettings, convert_to_mla
from dha_train.conversion.search import SearchSettings, run_search
from dha_train.families.base import ATTENTION_BIAS, QK_NORM
from dha_train.models.head_map import HeadMap
from dha_train.paths import recipe_path
from dha_train.stages import train_stage, train_tokens


class RealBench(StageRunner):
    """Which stages each method runs at a budget, in which order and with which settings; each public method adds
    that method's rows."""

    def heads(self, budget: str) -> int:
        """The K/V heads per layer a head-pooling method keeps at ``budget`` (run_real_bench skips the budgets where
        that is not a whole number)."""
        heads = budget_heads(budget, self.source_map.layers[0].num_key_heads)
        assert heads is not None, budget
        return heads

    def teacher(self) -> None:
        self.evaluate('teacher', 'teacher', None, self.source, 0, 0.0)

    def mean_pool(self, budget: str) -> None:
        name = f'meanpool-{budget}'
        converted = self.mean_pool_convert(budget)
        self.evaluate(f'mean-pool {budget} @0', 'mean_pool', budget, converted['hf_folder'], 0, converted['seconds'],
                      groups=converted['groups'])
        self.heal(name, f'mean-pool {budget}', 'mean_pool', budget, converted['hf_folder'], converted['seconds'])
        if not self.settings.ct:  # --no-ct: the 0-token and healing rows only
            return
        trained = self.ct(name, converted['hf_folder'])
        self.evaluate(f'mean-pool {budget} +CT', 'mean_pool', budget, trained['hf_folder'], trained['tokens'],
                      converted['seconds'] + trained['seconds'], groups=converted['groups'])

    def mean_pool_convert(self, budget: str) -> dict:
        """The stage ``meanpool-<budget>-convert``: the source mean-pooled to the budget's heads per layer."""
        heads = self.heads(budget)

        def convert(out: Path) -> dict:
            head_map = HeadMap.pooled(self.source_map, heads)
            hf = convert_checkpoint(self.source, out / 'hf', head_map, overwrite=True)
            return {'hf_folder': str(hf), 'groups': head_map.source_partitions(self.source_map)[0][0]}

        return self.stage(self.runs, f'meanpool-{budget}-convert', convert, heads=heads)

    def aligned_gqa(self, budget: str) -> None:
        heads = self.heads(budget)
        num_source = self.source_map.layers[0].num_key_heads
        if num_source % heads:
            reason = (f'aligned GQA needs equal groups: num_groups={heads} does not divide the source\'s {num_source} '
                      'K/V heads per layer')
            self.skipped.append({'method': 'aligned_gqa', 'budget': budget, 'reason': reason})
            say(f'aligned GQA {budget}: skipped ({reason})')
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

        if not self.settings.ct:  # --no-ct: the 0-token and healing rows only
            return
        pruned = self.train(f'{name}-prune', 'real/prune.yaml', self.batches, then=gates,
                            model_path=aligned['aligned'], teacher_path=self.source, num_groups=heads)
        self.evaluate(f'aligned GQA {budget} +prune', 'aligned_gqa', budget, pruned['hf_folder'], pruned['tokens'],
                      aligned['seconds'] + pruned['seconds'], calibration_tokens=aligned['calibration_tokens'],
                      gates_forced_closed=pruned['gates_forced_closed'])

    def asym_gqa(self, budget: str) -> None:
        heads = self.heads(budget)
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
            say(f'AsymGQA {budget}: {note}; mean-pool not run, so it runs here')
        converted = self._convert_to(f'{name}-convert', found['head_map'])
        seconds = found['seconds'] + converted['seconds']
        self.evaluate(f'AsymGQA {budget} @0', 'asym_gqa', budget, converted['hf_folder'], 0, seconds,
                      group_sizes=sizes, calibration_tokens=found['calibration_tokens'])
        self.heal(name, f'AsymGQA {budget}', 'asym_gqa', budget, converted['hf_folder'], seconds, group_sizes=sizes)
        if not self.settings.ct:  # --no-ct: the 0-token and healing rows only
            return
        trained = self.ct(name, converted['hf_folder'])
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
        if self.heads(budget) == 1:
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
        heads = self.heads(budget)
        # at one head per layer both Searches are skipped with the same map: the servable DHA shares DHA's stages
        name = f'dha-servable-{budget}' if servable and heads > 1 else f'dha-{budget}'
        method, title = ('dha_servable', 'DHA-servable') if servable else ('dha', 'DHA')
        found = self.dha_search(name, budget, servable)
        self._dha_start(name, budget, found, method, title)
        fused = self.dha_fusion(name, found['head_map'], self.batches)
        kv_heads = found['kv_heads']
        extra = {'kv_heads_per_layer': kv_heads, 'search_tokens': found['search_tokens'],
                 'fusion_batches': fused['batches'], 'fusion_converged_at': fused['converged_at'],
                 'final_fusion_loss': fused['final_fusion_loss']}
        seconds = found['seconds'] + fused['seconds']
        remaining = self.batches - fused['batches']
        # after Fusion is an intermediate row unless Fusion spent the whole budget (then it is DHA's own-training row)
        self.evaluate(f'{title} {budget} post-fusion', method, budget, fused['hf_folder'], fused['fusion_tokens'],
                      seconds, intermediate=remaining > 0, **extra)
        if remaining <= 0:
            self.skipped.append({'method': method, 'budget': budget, 'reason': (
                'fusion used the whole token budget (it did not reach the threshold earlier), so no CT: the '
                'post-fusion point is DHA\'s point at the common budget')})
            return
        trained = self.ct_after_fusion(name, fused['hf_folder'], remaining)
        self.evaluate(f'{title} {budget} +CT', method, budget, trained['hf_folder'],
                      fused['fusion_tokens'] + trained['tokens'], seconds + trained['seconds'],
                      ct_tokens=trained['tokens'], **extra)

    def dha_search(self, name: str, budget: str, servable: bool = False, seed: int | None = None) -> dict:
        """The stage ``<name>-search``: DHA's Search at the budget (``seed``, default the bench's, orders its
        batches), or, at one head per layer, the one map there is."""
        heads = self.heads(budget)
        s = self.settings
        fraction = heads / self.source_map.layers[0].num_key_heads
        search_overrides = self.overrides(name, s.search_batches, seed, model_path=self.source, kv_budget=fraction,
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

        return self.stage(self.runs, f'{name}-search', search, heads=heads, recipe=recipe_path(
            'real/dha_search.yaml').read_text(), overrides=search_overrides if heads > 1 else None)

    def dha_fusion(self, name: str, head_map: str, batches: int, seed: int | None = None) -> dict:
        """The stage ``<name>-fusion``: Fusion of the source grouped by ``head_map`` (the recipe's margin and lrs),
        stopping at its threshold or after ``batches``, baked and exported; its L_fusion history is kept."""
        s = self.settings

        def fusion_record(trainer, out: Path) -> dict:
            state = HeadFusion.of(trainer.state, 'bench real')
            history = state.history
            (out / 'fusion_history.json').write_text(json.dumps(history))
            return {'batches': len(history), 'converged_at': state.converged_at,
                    'fusion_tokens': len(history) * s.batch * s.seq_len,
                    'final_fusion_loss': history[-1]['fusion_loss'] if history else None}

        return self.train(f'{name}-fusion', 'real/fusion.yaml', batches, seed, then=fusion_record,
                          model_path=self.source, head_map=head_map)

    def _dha_start(self, name: str, budget: str, found: dict, method: str = 'dha', title: str = 'DHA') -> None:
        """DHA at 0 tokens: Fusion's start bakes to the mean of each Search group, so it is the Search's map
        mean-pooled; when that map is mean-pool's own, the mean-pool row is the same model and is reused."""
        head_map = HeadMap.load(found['head_map'])
        label = f'{title} {budget} @0'
        pooled = HeadMap.pooled(self.source_map, self.heads(budget)).source_partitions(self.source_map)
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
        fraction = budget_fraction(budget, self.source_map.layers[0].num_key_heads)
        settings = MlaSettings(cache_fraction=fraction, data=str(self.train_data),
                               tokens=s.calib_tokens, batch_size=min(8, s.batch), rank_step=1, seed=s.seed,
                               device=s.device)

        def convert(out: Path) -> dict:
            report = convert_to_mla(self.source, out / 'hf', settings, overwrite=True)
            return {'hf_folder': str(out / 'hf'), 'ranks': report['ranks'], 'rope_pairs': report['rope_pairs'],
                    'freq_fold': report['freq_fold'],
                    'calibration_tokens': report['calibration_tokens']}

        converted = self.stage(self.runs, f'{name}-convert', convert, **self.calibration(settings))
        extra = {'latent_ranks': [min(converted['ranks']), max(converted['ranks'])],
                 'rope_pairs': converted['rope_pairs'], 'freq_fold': converted['freq_fold'],
                 'calibration_tokens': converted['calibration_tokens']}
        self.evaluate(f'MLA {budget} @0', 'mla', budget, converted['hf_folder'], 0, converted['seconds'], **extra)
        # refit's latent regression has no bias term and no k_norm: such a source's MLA heals from attention transfer
        config = model_config(self.source)
        family = families.of(config, 'bench real')
        unrefittable = any(feature.name in (ATTENTION_BIAS.name, QK_NORM.name) and feature.present(config)
                           for feature in family.features)
        self.heal(name, f'MLA {budget}', 'mla', budget, converted['hf_folder'], converted['seconds'],
                  refit=False if unrefittable else None, **extra)
        if not self.settings.ct:  # --no-ct: the 0-token and healing rows only
            return
        trained = self.ct(name, converted['hf_folder'])
        self.evaluate(f'MLA {budget} +CT', 'mla', budget, trained['hf_folder'], trained['tokens'],
                      converted['seconds'] + trained['seconds'], **extra)

    def mla_deepseek(self, budget: str) -> None:
        """MLA in DeepSeek's format at the budget's cache bytes: 0 tokens with the conversion's defaults (the latent
        in the norm's linear range), the same conversion calibrated on the refit's tokens as its refit, then
        attention transfer and KL (``heal``)."""
        s = self.settings
        name = f'mla-deepseek-{budget}'
        fraction = budget_fraction(budget, self.source_map.layers[0].num_key_heads)

        def converter(tokens: int):
            settings = DeepseekSettings(cache_fraction=fraction, data=str(self.train_data),
                                        tokens=tokens, batch_size=min(8, s.batch), seed=s.seed, device=s.device)

            def convert(out: Path) -> dict:
                report = convert_to_deepseek(self.source, out / 'hf', settings, overwrite=True)
                return {'hf_folder': str(out / 'hf'), 'calibration_tokens': report['calibration_tokens'],
                        **{key: report[key] for key in ('kv_lora_rank', 'qk_rope_head_dim', 'rope_stride',
                                                        'rope_energy_kept')}}
            return convert, self.calibration(settings)

        build, reads = converter(s.calib_tokens)
        converted = self.stage(self.runs, f'{name}-convert', build, **reads)
        extra = {key: converted[key] for key in ('kv_lora_rank', 'qk_rope_head_dim', 'rope_stride',
                                                  'rope_energy_kept')}
        self.evaluate(f'MLA-DeepSeek {budget} @0', 'mla_deepseek', budget, converted['hf_folder'], 0,
                      converted['seconds'], **extra)
        self.heal(name, f'MLA-DeepSeek {budget}', 'mla_deepseek', budget, converted['hf_folder'],
                  converted['seconds'], refit=converter(s.refit_tokens), **extra)

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
        # healed: attention transfer and KL from the source on the surgery's model (no refit: no K/V head is pooled)
        self.heal(name, f'MoH {active}/{heads}', 'moh', None, converted['hf_folder'], converted['seconds'],
                  refit=False, **setting)
        if not self.settings.ct:  # --no-ct: the 0-token and healing rows only
            return
        trained = self.train(f'{name}-continue', 'real/moh.yaml', self.batches, model_path=self.source,
                             shared_heads=shared, top_k=top_k)
        self.evaluate(f'MoH {active}/{heads} +CT', 'moh', None, trained['hf_folder'], trained['tokens'],
                      converted['seconds'] + trained['seconds'], **setting)



def moh_at_surgery(source: str | Path, out: str | Path, shared_heads: int, top_k: int) -> Path:
    """The MoH model right after surgery (no training): the source's weights under the MoH class with a query-norm
    router (which has no weights), written as an HF folder through the MoH method's own export."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dha_train.methods import export_model, tag_method
    from dha_train.model_folders import load_source_config
    from dha_train.models.modeling_moh import check_moh_settings
    from dha_train.tokenizer_files import load_tokenizer_folder

    source, out = Path(source), Path(out)
    config = load_source_config(source, who='bench real (MoH source)')
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
    load_tokenizer_folder(source, 'bench real (MoH source)').save_pretrained(out)
    return out





def _same_partitions(a, b) -> bool:
    def canonical(partitions):
        return [[sorted(sorted(group) for group in layer) for layer in kind] for kind in partitions]

    return canonical(a) == canonical(b)
