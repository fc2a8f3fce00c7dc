"""Text that comes from other programs, made safe to print."""


def printable(text: str) -> str:
    """text with control characters escaped (\\n, \\x1b, ...): a program's arguments may hold
    newlines or terminal escape sequences that must not reach a terminal or break a table."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
