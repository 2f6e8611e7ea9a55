// The reduction loop for AVX-512 (F, BW, VL) hosts, chosen at run time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "isa.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define COMMLAB_ISA avx512
#include "isa_unit.inc"
#pragma GCC pop_options
