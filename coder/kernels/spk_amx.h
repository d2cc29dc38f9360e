// Whether this process may use AMX tiles of a kind: the CPU's CPUID bit, and the kernel's grant
// of the tile state (Linux hands a thread AMX's tile data only after arch_prctl(ARCH_REQ_XCOMP_PERM)
// for the process); and the one tile configuration every AMX kernel here loads. Shared by the int8
// attention (spk_attn_amx.h), the W8A8 linear (spk_w8a8_amx.h) and the FP8 replay (spk_fp8_amx.h).
#pragma once
#include <cpuid.h>
#include <cstdint>
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

// Whether this CPU and kernel let this process use AMX int8 tiles (asked once).
inline bool amx_int8_ready() {
    static const bool yes = amx_granted(AMX_INT8_BIT);
    return yes;
}

constexpr int AMX_TILES = 8, AMX_TILE_ROWS = 16, AMX_TILE_BYTES = 64;  // a tile: 16 rows of 64 bytes

// Palette 1, tiles 0-7 each AMX_TILE_ROWS rows of AMX_TILE_BYTES bytes; each kernel says what it keeps
// in which tile.
struct alignas(64) AmxTileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    AmxTileConfig() {
        for (int t = 0; t < AMX_TILES; ++t) colsb[t] = AMX_TILE_BYTES, rows[t] = AMX_TILE_ROWS;
    }
};

}  // namespace spk
