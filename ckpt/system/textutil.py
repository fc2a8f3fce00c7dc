"""Text for people: text that comes from other programs made safe to print, and sizes."""


def printable(text: str) -> str:
    """text with control characters escaped (\\n, \\x1b, ...): a program's arguments may hold
    newlines or terminal escape sequences that must not reach a terminal or break a table."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def human_bytes(n: int | float | None) -> str:
    """A size for people, in binary units (KiB, MiB, GiB, TiB): the one convention of ckpt's
    messages, tables and progress bars (--json gives bytes)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
