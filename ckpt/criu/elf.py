"""The ELF build id of a file, found exactly as CRIU finds it (criu/files-reg.c, get_build_id).

CRIU records the build id of every ELF file the tree had open or mapped and, on restore,
refuses a file whose build id differs. ckpt checks before CRIU runs, so it must find the same
id CRIU would, or nothing where CRIU finds nothing: only the first MiB of the file is read,
the id is the first NT_GNU_BUILD_ID note of a PT_NOTE segment (whatever its owner name), of
1 to 512 bytes. No pycriu needed.
"""

from __future__ import annotations

import struct

MAP_SIZE = 1 << 20  # CRIU's BUILD_ID_MAP_SIZE: "most likely present in the beginning of the file"
PT_NOTE = 4
NT_GNU_BUILD_ID = 3
NOTE_HEADER = 12  # Elf32_Nhdr and Elf64_Nhdr alike: namesz, descsz, type (32 bits each)


def _align4(n: int) -> int:
    return (n + 3) & ~3


def build_id(path: str) -> bytes | None:
    """The file's build id, or None when it has none CRIU would find (not ELF, no note, too
    short, unreadable)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAP_SIZE)
    except OSError:
        return None
    return build_id_of(data)


def build_id_of(data: bytes) -> bytes | None:
    """The build id in the first MiB of an ELF file (see build_id)."""
    if len(data) < 5 or data[:4] != b"\x7fELF":
        return None
    order = ">" if data[5:6] == b"\x02" else "<"  # EI_DATA: ELFDATA2MSB, else little-endian
    # The ELF header after e_ident: e_type, e_machine, e_version, e_entry, e_phoff [4], e_shoff,
    # e_flags, e_ehsize, e_phentsize, e_phnum [9], ...; then one program header's layout.
    if data[4] == 1:  # ELFCLASS32
        header, phdr = order + "16xHHIIIIIHHHHHH", order + "IIIIIIII"
    elif data[4] == 2:  # ELFCLASS64
        header, phdr = order + "16xHHIQQQIHHHHHH", order + "IIQQQQQQ"
    else:
        return None
    if len(data) < struct.calcsize(header):
        return None
    fields = struct.unpack_from(header, data)
    phoff, phnum = fields[4], fields[9]
    phsize = struct.calcsize(phdr)
    for i in range(phnum):
        at = phoff + i * phsize
        if phoff == 0 or at + phsize > len(data):
            break
        entry = struct.unpack_from(phdr, data, at)
        if entry[0] != PT_NOTE:
            continue
        # 32-bit: p_type, p_offset, p_vaddr, p_paddr, p_filesz...; 64-bit: p_type, p_flags, p_offset, ... p_filesz
        offset, filesz = (entry[1], entry[4]) if data[4] == 1 else (entry[2], entry[5])
        found = _note_in(data, order, offset, filesz)
        if found is not None:
            return found or None  # b"": CRIU stops at an unusable note
    return None


def _note_in(data: bytes, order: str, offset: int, filesz: int) -> bytes | None:
    """The build id among the notes at offset (None: not there; b"": there but unusable)."""
    if offset == 0:
        return None
    end = min(offset + filesz, len(data) - NOTE_HEADER)
    at = offset
    while at <= end:
        namesz, descsz, kind = struct.unpack_from(order + "III", data, at)
        if kind == NT_GNU_BUILD_ID:
            if not 0 < descsz <= 512:
                return b""
            start = at + NOTE_HEADER + _align4(namesz)
            if start + descsz > len(data):
                return b""
            return data[start:start + descsz]
        at += NOTE_HEADER + _align4(namesz) + _align4(descsz)
    return None
