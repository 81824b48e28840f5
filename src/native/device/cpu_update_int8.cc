// cpu_update.h's entry for int8 moments (a unit of its own: see there why).
#include "device/cpu_update_impl.h"

SMARTINF_CPU_UPDATE(run_update_int8, store::Moments::int8)
