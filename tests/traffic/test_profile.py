import json

import pytest

from extproc.traffic import ProfileError, available_profiles, check_context, load_profile
from extproc.traffic.generator import generate_conversations
from extproc.traffic.profile import PROFILES_DIR


def write(tmp_path, **changes):
    raw = json.loads((PROFILES_DIR / "quick.json").read_text())
    for key, value in changes.items():
        if value is None:
            del raw[key]
        else:
            raw[key] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    return path


def test_shipped_profiles_load():
    assert {"quick", "standard"} <= set(available_profiles())
    for name in available_profiles():
        assert load_profile(name).name == name


def test_missing_field_is_named(tmp_path):
    with pytest.raises(ProfileError, match=r"doc_share: missing"):
        load_profile(write(tmp_path, doc_share=None))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("turns", [5, 2], r"turns: needs 0 <= low <= high"),
        ("turns", 3, r"turns: must be a \[low, high\] pair"),
        ("concurrency", "6", r"concurrency: must be an integer"),
        ("concurrency", True, r"concurrency: must be an integer"),
        ("doc_share", 1.5, r"doc_share: must be between 0 and 1"),
        ("max_tokens", 0, r"max_tokens: must be > 0"),
        ("stream", "yes", r"stream: must be true or false"),
        ("turnz", [1, 2], r"turnz: unknown field"),
    ],
)
def test_wrong_field_is_named(tmp_path, field, value, message):
    with pytest.raises(ProfileError, match=message):
        load_profile(write(tmp_path, **{field: value}))


def test_all_problems_reported_at_once(tmp_path):
    with pytest.raises(ProfileError) as info:
        load_profile(write(tmp_path, turns=None, max_tokens=-1))
    assert "turns: missing" in str(info.value) and "max_tokens: must be > 0" in str(info.value)


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ProfileError, match=r"profile not found: nope .*quick"):
        load_profile("nope")


def test_invalid_json_is_reported(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(path)


def test_first_turn_longer_than_the_context_is_refused(tmp_path):
    profile = load_profile(write(tmp_path, doc_share=1.0, doc_words=[2000, 2000]))
    with pytest.raises(ProfileError, match="does not fit in max_context_tokens"):
        generate_conversations(profile, 1)


def test_context_check_against_the_replicas_slot():
    quick = load_profile("quick")  # max_context_tokens = 1536
    check_context(quick, slot_context_tokens=2048)
    with pytest.raises(ProfileError, match=r"max_context_tokens=1536 exceeds the replicas' per-slot context 1024"):
        check_context(quick, slot_context_tokens=1024)
