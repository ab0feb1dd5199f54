"""``untrusted.plain_name``, the one rule for a name read from a folder's data: a plain name inside that folder, or a
refusal naming it. The readers' own tests (data, weights, tokenizers) run it through the commands; here, its edges."""

from __future__ import annotations

import pytest

from dha_train.untrusted import UntrustedDataError, plain_name


@pytest.mark.parametrize('name', ['../x', '/etc/passwd', '', '.', '..', 'a/b', 'a\\b', 'a\0b', 7, None])
def test_names_that_are_not_plain_are_refused(name):
    with pytest.raises(UntrustedDataError, match='not a plain file name'):
        plain_name(name, 'index.json', 'a shard')


def test_an_mds_index_may_name_its_own_subfolders_but_not_climb_out():
    assert plain_name('part-00000/shard.00000.mds', 'index.json', subfolders=True) == 'part-00000/shard.00000.mds'
    for name in ('part/../../x', '/abs/shard.mds', 'part//shard.mds'):
        with pytest.raises(UntrustedDataError):
            plain_name(name, 'index.json', subfolders=True)


def test_a_hub_cache_snapshot_may_link_into_its_own_blobs_and_nowhere_else(tmp_path):
    """transformers' hub cache keeps a snapshot's files as links to ../../blobs/<hash>: the model repository's own
    store, so they load; a link from the snapshot to any other file is refused."""
    repo = tmp_path / 'models--org--tiny'
    (repo / 'blobs').mkdir(parents=True)
    (repo / 'blobs' / 'a1b2').write_text('{}')
    snapshot = repo / 'snapshots' / 'rev0'
    snapshot.mkdir(parents=True)
    (snapshot / 'config.json').symlink_to('../../blobs/a1b2')
    assert plain_name('config.json', 'model folder', folder=snapshot) == 'config.json'
    (tmp_path / 'secret.txt').write_text('secret')
    (snapshot / 'vocab.txt').symlink_to(tmp_path / 'secret.txt')
    with pytest.raises(UntrustedDataError, match='leads out of'):
        plain_name('vocab.txt', 'model folder', folder=snapshot)
    # the same link layout outside a hub cache's snapshots folder leads out
    plain = tmp_path / 'plain'
    (plain / 'sub').mkdir(parents=True)
    (tmp_path / 'blobs').mkdir()
    (tmp_path / 'blobs' / 'c3').write_text('{}')
    (plain / 'sub' / 'config.json').symlink_to('../../blobs/c3')
    with pytest.raises(UntrustedDataError, match='leads out of'):
        plain_name('config.json', 'model folder', folder=plain / 'sub')
