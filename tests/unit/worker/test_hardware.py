"""What a worker says about its hardware at registration (services/worker/hardware.py)."""

from __future__ import annotations

from services.worker import hardware


def test_the_cpu_generation_is_its_widest_vector_extension():
    assert hardware.cpu_generation("processor: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n") == "cpu-avx512"
    assert hardware.cpu_generation("flags : fpu avx avx2\n") == "cpu-avx2"
    assert hardware.cpu_generation("flags : fpu sse4_2\n") == "cpu"
    assert hardware.cpu_generation("") == "cpu"  # unreadable: the kind only


def test_headroom_is_memavailable_and_unknown_is_zero():
    assert hardware.mem_available_bytes("MemTotal: 100 kB\nMemAvailable:   2048 kB\n") == 2048 * 1024
    assert hardware.mem_available_bytes("MemTotal: 100 kB\n") == 0
    assert hardware.mem_available_bytes("MemAvailable: lots kB\n") == 0


def test_this_machine_reads_as_a_cpu_with_headroom():
    assert hardware.accelerator_generation("cpu").startswith("cpu")
    assert hardware.memory_headroom_bytes("cpu") > 0
    assert hardware.accelerator_generation("tpu") == "" and hardware.memory_headroom_bytes("tpu") == 0
