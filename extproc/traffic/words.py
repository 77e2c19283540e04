"""Deterministic filler text: plain English words drawn from a fixed list.

The models here are tiny or random-weight, so content does not matter; what matters
is that text is reproducible from a seed, tokenizes like ordinary English (about
four characters per token) and differs between conversations, so no two
conversations share a cached prefix beyond the chat template.
"""

from __future__ import annotations

import random

_WORD_LIST = """
    about above across after again against along already also always among answer any area
    around back because become before begin behind being below between both bring build
    business call came carry case cause certain change check child city clear close come
    common company consider continue control could country course cover create cut data day
    decide deep design detail develop different direction distance during each early easy
    effect either energy enough even event every example experience explain face fact family
    far feel field figure final find first follow force form forward free friend full future
    game general give good government great green ground group grow half hand happen hard
    head hear heart help high history hold home hope house however human idea important
    include increase indeed inside interest issue keep kind know land large last late later
    lead learn least leave less level life light likely line list little live local long
    look machine main major make manage many market matter mean measure member method middle
    might mind minute model moment money month more morning most mother move much music must
    name nation nature near need network never next night north note nothing notice number
    object offer office often open order other outside over own page paper part particular
    party pass past pattern people perhaps period person picture piece place plan plant
    point policy position possible power present press pretty price private problem process
    produce program project provide public purpose question quickly quite rather reach read
    ready real reason receive record reduce region remain remember report require research
    result return right river road rock room rule run same save school science season second
    section seem sense serve service several shape share short should show side simple since
    single small social society someone something sound source south space speak special
    stand start state station still story street strong structure student study subject
    success such summer support sure surface system table take talk task teach team tell
    term test than that their theory there these thing think third those though thought
    through time today together toward travel tree true turn type under understand unit
    until upon usually value various very view visit voice wait walk wall want watch water
    way weather week weight well west what where whether which while white whole why wide
    will window winter within without woman wonder word work world would write year young
"""
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())


def sentence(rng: random.Random, words: int) -> str:
    """``words`` words, capitalised and ending with a full stop."""
    picked = [rng.choice(WORDS) for _ in range(max(1, words))]
    return " ".join(picked).capitalize() + "."


def paragraphs(rng: random.Random, words: int, per_sentence: int = 14, per_paragraph: int = 6) -> str:
    """About ``words`` words as sentences grouped in paragraphs (a pasted document)."""
    sentences = []
    left = words
    while left > 0:
        n = min(left, per_sentence)
        sentences.append(sentence(rng, n))
        left -= n
    groups = [sentences[i : i + per_paragraph] for i in range(0, len(sentences), per_paragraph)]
    return "\n\n".join(" ".join(group) for group in groups)
