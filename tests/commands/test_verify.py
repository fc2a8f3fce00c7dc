"""ckpt/commands/verify.py: every checkpoint's bytes checked, damage named with its checkpoint."""

from ckpt.commands.verify import verify
from tests.commands.conftest import BASE, PAGE, Heard, Images, as_json, flip_byte, page


def test_an_intact_store_verifies_clean(store, checkpoints):
    made = [checkpoints.make("web"), checkpoints.make("db")]
    heard = Heard()
    assert as_json(verify(store, None, heard)) == [{"id": m.id, "files": len(m.files), "problems": []}
                                                   for m in made]
    assert heard.of("step") == [f"verifying {m.id}" for m in made]


def test_a_flipped_byte_in_a_pack_is_found_and_names_its_checkpoint(store, checkpoints):
    clean = checkpoints.make("clean", Images({BASE: page("clean")}), codec="none")
    packs_of_clean = store.backend.list("packs/")
    hit = checkpoints.make("hit", Images({BASE: page("hit"), BASE + PAGE: page("hit too")}), codec="none")
    (new_pack,) = {info.name for info in store.backend.list("packs/")} - {info.name for info in packs_of_clean}
    flip_byte(store.backend, new_pack, PAGE + 100)
    results = {r["id"]: r["problems"] for r in as_json(verify(store, None))}
    assert results[clean.id] == []
    assert results[hit.id] and any("pages-1.img" in problem for problem in results[hit.id]), results[hit.id]
    (only,) = as_json(verify(store, "hit"))
    assert only["id"] == hit.id and only["problems"]


def test_an_unreadable_manifest_is_a_problem_of_its_checkpoint(store, checkpoints):
    broken = checkpoints.make("web")
    store.backend.put(f"checkpoints/{broken.id}.json", b"{}")
    (result,) = as_json(verify(store, None))
    assert result["id"] == broken.id and result["files"] == 0 and "lacks" in result["problems"][0]

