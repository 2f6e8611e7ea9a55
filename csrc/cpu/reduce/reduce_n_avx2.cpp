// The reduction loop for AVX2 + FMA + F16C hosts, chosen at run time (never -march=native).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "isa.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define COMMLAB_ISA avx2
#include "isa_unit.inc"
#pragma GCC pop_options
