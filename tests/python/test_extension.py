"""The compiled extension as a process loads it beside torch (issue 14).

With a toolchain that links libstdc++ statically (a GCC beside the system's, CXX=/opt/gcc/bin/g++
on the GPU machine), the extension exported its copy of libstdc++; the dynamic linker bound some of
those symbols to the process's own libstdc++ (loaded by torch) and others to the copy, whose locale
facets disagree, and the first ostringstream in BucketLayout segfaulted. The build now exports
PyInit__tide alone (python/exports.map), so every symbol binds inside the extension whichever way
libstdc++ is linked. This test reads the extension's dynamic symbol table itself (no binutils
needed): it fails on a build that exports anything else, as every build before the fix did."""

import struct
import subprocess
import sys

import tide
from tide import _tide

SHT_DYNSYM = 11
SHN_UNDEF = 0
STB_LOCAL = 0


def defined_dynamic_symbols(path: str) -> list:
    """Names of the symbols an ELF64 little-endian shared object defines in its .dynsym."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path}: not an ELF64 LE file"
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    names = []
    for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
        if sh_type != SHT_DYNSYM:
            continue
        strtab_offset = sections[link][4]
        for k in range(size // entsize):
            st_name, st_info, _, st_shndx, _, _ = struct.unpack_from("<IBBHQQ", data, offset + k * entsize)
            if st_shndx == SHN_UNDEF or (st_info >> 4) == STB_LOCAL or st_name == 0:
                continue
            end = data.index(b"\0", strtab_offset + st_name)
            names.append(data[strtab_offset + st_name:end].decode())
    return names


def test_extension_exports_only_its_module_init():
    exported = defined_dynamic_symbols(_tide.__file__)
    assert exported == ["PyInit__tide"], (
        f"{_tide.__file__} exports {len(exported)} symbols, e.g. {exported[:5]}: a statically linked "
        "libstdc++ or template instantiations would interpose with the process's (see python/exports.map)")


def test_layout_errors_format_numbers_after_torch_loaded_libstdcxx():
    # The crash's path: torch first (its libstdc++ in the process), then a BucketLayout whose
    # construction formats size_t values. Run in a fresh interpreter so a crash is a failure, not
    # the end of the test session.
    code = (
        "import torch, tide\n"
        "specs = [tide.ParamSpec('w', [64, 64], tide.DType.bf16, tide.DType.fp32)]\n"
        "layout = tide.BucketLayout(specs, tide.Topology.single_node(2))\n"
        "assert layout.window_bytes == 8192, layout.window_bytes\n"
        "try:\n"
        "    tide.BucketLayout([tide.ParamSpec('w', [3, 0], tide.DType.bf16, tide.DType.fp32)],\n"
        "                      tide.Topology.single_node(2))\n"
        "except ValueError as e:\n"
        "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "BucketLayout: param 0 ('w'): shape[1] = 0, expected > 0" in done.stdout, done.stdout
