// Every constant of speckv's per-scalar pipeline, in one place for the native
// sources (the CPU extension spk_native.cpp and the CUDA kernels spk_fused.cu).
// The numpy reference spells the same values in coder/rans.py, coder/tables.py
// and coder/model.py; tests/coder/test_native.py checks that they agree (the
// extension exports these as module constants).
#pragma once

// -- rANS (coder/rans.py) ----------------------------------------------------
#define SPK_PROB_BITS 15u                      // frequencies are 15-bit fixed point
#define SPK_PROB_SCALE (1u << SPK_PROB_BITS)    // an alphabet's frequencies sum to this
#define SPK_PROB_MASK (SPK_PROB_SCALE - 1u)     // state & mask = decoder slot
#define SPK_LANES 32u                           // lanes per block: one warp
#define SPK_WORD_BITS 16u                       // renormalisation words are uint16
#define SPK_RANS_L (1u << 16)                   // state lower bound between ops
#define SPK_X_MAX_SHIFT 17u                     // x_max = 2**17 * freq (see rans.py NOTE)
#define SPK_BUCKET_SHIFT 7u                     // decoder lookup: slot >> 7 -> first symbol
#define SPK_BUCKETS (SPK_PROB_SCALE >> SPK_BUCKET_SHIFT)  // per table

// -- probability tables (coder/tables.py) --------------------------------------
#define SPK_SIGMA_FRAC_BITS 3                   // log2 sigma in 1/8 octaves
#define SPK_SIGMA_ONE (1 << SPK_SIGMA_FRAC_BITS)
#define SPK_GRID_BELOW_SIGMA 4                  // bins are at most sigma / 2^4 wide
#define SPK_LAMBDA_MIN (-5 * SPK_SIGMA_ONE)
#define SPK_LAMBDA_MAX (((SPK_GRID_BELOW_SIGMA + 1) << SPK_SIGMA_FRAC_BITS) - 1)
#define SPK_OFFSET_BITS 3                       // mu's position in its bin, 1/8 steps
#define SPK_OFFSETS (1 << SPK_OFFSET_BITS)
#define SPK_LAMBDA_OFFSET (1 << SPK_SIGMA_FRAC_BITS)  // offsets matter below this lambda
#define SPK_N_GAUSS ((SPK_LAMBDA_OFFSET - SPK_LAMBDA_MIN) * SPK_OFFSETS + (SPK_LAMBDA_MAX - SPK_LAMBDA_OFFSET + 1))
#define SPK_NOOP_TABLE SPK_N_GAUSS              // the padding op's row (one symbol, freq = scale)
#define SPK_SHIFT_MAX 127                       // format 4: |sigma shift| per (layer, kv, head), 1/8 octaves

// -- probability model (coder/model.py) ----------------------------------------
#define SPK_MAX_BIN 4095                        // bins beyond this escape
#define SPK_NEAR_TOP_Q8 13                      // 8 * log2(3): "within 3 sigma of the binade top"

// -- element kinds (what the bit sections hold for an element) -------------------
#define SPK_KIND_NORMAL 0u                      // LOW: nb low significand bits
#define SPK_KIND_ZERO 1u                        // ZMAN: mantissa, UNARY: exponent distance
#define SPK_KIND_ESC 2u                         // ESC: the raw bit pattern

// -- status codes the native coders report (coder/native.py maps them to errors) --
// NOTE: a chunk reports the first failing check in the numpy decoder's order
// (model.desymbolize); the rANS checks of all blocks come before any of these.
#define SPK_OK 0
#define SPK_ERR_WORDS_UNDERRUN 1                // rANS: read past the start of a block's words
#define SPK_ERR_WORDS_LEFT 2                    // rANS: words left unread
#define SPK_ERR_FINAL_STATE 3                   // rANS: final state is not RANS_L
#define SPK_ERR_SHORT 4                         // bit sections need more bytes than present
#define SPK_ERR_UNARY_LONG 5                    // unary section longer than any encoder writes
#define SPK_ERR_PADDING 6                       // non-zero padding after bit fields
#define SPK_ERR_NO_FINITE 7                     // a bin that holds no finite value of the format
#define SPK_ERR_UNARY_COUNT 8                   // not exactly one unary code per zero-bin element
#define SPK_ERR_UNARY_TAIL 9                    // the unary section does not end with its last code
#define SPK_ERR_ZERO_EXP 10                     // zero-bin exponent distance out of range
#define SPK_ERR_NOT_ESCAPED 11                  // an element with non-finite mu was not escaped
