// Loop-budget guard. llvmpipe (lavapipe, Mesa's GL on a CPU) counts the
// loop iterations of every 8 invocations it runs together, across all loops
// of the shader, and once the count reaches 65535 (gallivm's
// LP_MAX_TGSI_LOOP_ITERATIONS) it leaves every loop after its current
// iteration: a long kernel silently stops short. On such adapters the
// composer emits `@on` and every entry point ends with check_loop_budget(),
// which runs a two-iteration loop the compiler cannot unroll (its bound is
// read from the buffer, whose second word stays 0): if the loop stopped
// after one iteration, the budget was spent and word 0 is set, and the
// engine reruns the call in shorter pieces. Elsewhere `@off` compiles to
// nothing. `@meter` (tests only) measures instead: a loop that runs until
// the budget is spent leaves the fewest iterations any invocation had left
// in word 1, so the host learns the iterations the kernel took.
// @off
fn check_loop_budget() {}
// @on
@group(0) @binding(16) var<storage, read_write> loop_budget: array<u32, 2>;
fn check_loop_budget() {
    let stop = 2u + loop_budget[1];
    var taken = 0u;
    loop {
        taken += 1u;
        if (taken >= stop) {
            break;
        }
    }
    if (taken < stop) {
        loop_budget[0] = 1u;
    }
}
// @meter
@group(0) @binding(16) var<storage, read_write> loop_budget: array<atomic<u32>, 2>;
fn check_loop_budget() {
    var left = 0u;
    loop {
        if (left >= 1000000u) {
            break;
        }
        left += 1u;
    }
    atomicMin(&loop_budget[1], left);
}
