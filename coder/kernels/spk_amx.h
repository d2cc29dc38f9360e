// Whether this process may use AMX tiles of a kind: the CPU's CPUID bit, and the kernel's grant
// of the tile state (Linux hands a thread AMX's tile data only after arch_prctl(ARCH_REQ_XCOMP_PERM)
// for the process). Shared by the int8 attention (spk_attn_amx.h) and the FP8 replay (spk_fp8_amx.h).
#pragma once
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace spk {

constexpr unsigned AMX_BF16_BIT = 22, AMX_TILE_BIT = 24, AMX_INT8_BIT = 25;  // CPUID.(7,0):EDX

inline bool amx_granted(unsigned edx_bit) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> AMX_TILE_BIT) & 1u) || !((d >> edx_bit) & 1u))
        return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

}  // namespace spk
