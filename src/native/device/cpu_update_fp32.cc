// cpu_update.h's entry for fp32 moments (a unit of its own: see there why).
#include "device/cpu_update_impl.h"

SMARTINF_CPU_UPDATE(run_update_fp32, store::Moments::fp32)
