// The browser test: serves web/ on a localhost port, loads /?selftest in
// headless Chromium with WebGPU enabled, waits for the page's checks (GPU
// work, which Chromium's own --dump-dom would not wait for), asserts its
// results and saves a screenshot. Exits non-zero on any failure, including a
// missing WebGPU adapter: nothing here is skipped.
//
// Environment: CHROMIUM (default /usr/bin/chromium), SCREENSHOT (default
// web/test-results/screenshot.png, so test runs leave the committed
// web/screenshot.png alone; set SCREENSHOT=web/screenshot.png to refresh it),
// RESULTS (default web/test-results/results.json), STALL_S (default 300: how
// long the page may go without finishing a check) and CHECK_S (default 60:
// the whole run may take the page's number of checks times this).
//
// The wait follows the page's progress (window.flashattnResults.progress:
// checks finished out of the total it runs), so a slower host gets more
// time as long as the page keeps moving; a page stuck on one check fails
// after STALL_S with the check it was on.
import { chromium } from 'playwright-core';
import http from 'node:http';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const webDir = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const screenshotPath = path.resolve(process.env.SCREENSHOT || path.join(webDir, 'test-results', 'screenshot.png'));
const resultsPath = path.resolve(process.env.RESULTS || path.join(webDir, 'test-results', 'results.json'));
const stallMs = Number(process.env.STALL_S || 300) * 1000;
const perCheckMs = Number(process.env.CHECK_S || 60) * 1000;
const executablePath = process.env.CHROMIUM || '/usr/bin/chromium';

const failures = [];
function expect(ok, what) {
  if (!ok) failures.push(what);
  return ok;
}
const finite = (x) => typeof x === 'number' && Number.isFinite(x);

const types = { '.html': 'text/html', '.js': 'text/javascript', '.wasm': 'application/wasm', '.png': 'image/png' };
function serve() {
  const server = http.createServer((req, res) => {
    const url = new URL(req.url, 'http://localhost');
    const rel = url.pathname === '/' ? 'index.html' : decodeURIComponent(url.pathname).replace(/^\/+/, '');
    const file = path.resolve(webDir, rel);
    if (!file.startsWith(webDir + path.sep) || !fs.existsSync(file) || !fs.statSync(file).isFile()) {
      res.writeHead(404).end('not found');
      return;
    }
    res.writeHead(200, { 'content-type': types[path.extname(file)] || 'application/octet-stream' });
    fs.createReadStream(file).pipe(res);
  });
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve(server)));
}

// Verified on first use: every kernel family the page ran was checked once,
// before its first call, and passed; each call's stats name its family's verdict.
function checkVerdicts(r) {
  const v = r.verdicts;
  if (!expect(v && Array.isArray(v.known), 'no verification verdicts')) return;
  console.log(`  verified on first use: ${v.checks_run} families, ${v.check_ms.toFixed(0)} ms of checks: ` +
    v.known.map((k) => `${k.family} ${k.call} ${k.precision} ${k.verdict} (${k.ms.toFixed(0)} ms)`).join(', '));
  expect(v.mode === 'first_use', `verification mode ${v.mode}`);
  expect(v.known.length > 0 && v.checks_run === v.known.length,
    `${v.checks_run} checks for ${v.known.length} families: each family is checked exactly once`);
  for (const k of v.known) {
    const name = `${k.family} ${k.call} ${k.precision} (${k.flags.join(', ')})`;
    expect(k.verdict === 'verified' && !k.cached && k.ms > 0, `${name}: ${k.verdict}, ${k.ms} ms, cached ${k.cached}`);
    expect(/^[a-z]+: max error /.test(k.detail || ''), `${name}: detail ${k.detail}`);
  }
  const has = (family, call, precision) => v.known.some((k) => k.family === family && k.call === call && k.precision === precision);
  for (const c of r.cases || []) {
    const name = `seqlen ${c.seqlen} d ${c.head_dim} ${c.precision}`;
    expect(has(c.kernel, 'forward', c.precision), `${name}: no verdict for ${c.kernel} forward ${c.precision}`);
    expect(has(c.backward_kernel, 'backward', c.precision), `${name}: no verdict for ${c.backward_kernel} backward ${c.precision}`);
    expect(c.verification.startsWith(`${c.kernel} forward ${c.precision}`) && c.verification.endsWith(': verified'),
      `${name}: forward verification ${c.verification}`);
    expect(c.backward_verification.startsWith(`${c.backward_kernel} backward ${c.precision}`) && c.backward_verification.endsWith(': verified'),
      `${name}: backward verification ${c.backward_verification}`);
  }
  for (const c of [...(r.layouts || []), ...(r.decode || [])]) {
    expect(typeof c.verification === 'string' && c.verification.endsWith(': verified'), `${c.name || 'decode'} ${c.precision}: verification ${c.verification}`);
  }
  for (const c of r.decode || []) expect(/^[a-z]+ decode /.test(c.verification), `decode verification ${c.verification}`);
}

function checkResults(r) {
  if (!expect(r.error === null, `the page reported an error: ${r.error}`)) return;
  expect(r.progress.finished === r.progress.total, `the page finished ${r.progress.finished} of ${r.progress.total} checks`);
  const dev = r.device;
  const info = dev.js_info || {};
  expect(dev.backend === 'BrowserWebGpu', `wgpu backend ${dev.backend}, expected BrowserWebGpu`);
  expect(Boolean(dev.adapter || info.vendor || info.architecture || info.description), 'the adapter has no name or info');
  const m = dev.granted.max_compute_workgroup_storage_size;
  expect(m >= dev.webgpu_defaults.max_compute_workgroup_storage_size,
    `granted workgroup storage ${m} is below the WebGPU default`);
  if (!dev.shader_f16) {
    expect(dev.f16_storage === 'f16 (packed u32)', `without shader-f16 the f16 path is ${dev.f16_storage}, not packed`);
  }

  // Coverage: every (causal, precision) pair at sizes that are not multiples of the tiles.
  const combos = new Set(r.cases.map((c) => `${c.causal}/${c.precision}`));
  for (const want of ['false/f32', 'true/f32', 'false/f16', 'true/f16', 'false/bf16', 'true/bf16']) {
    expect(combos.has(want), `no case for causal/precision ${want}`);
  }
  expect(r.cases.some((c) => c.seqlen % 4 !== 0 && c.head_dim % 4 !== 0), 'no odd-size case');
  // The registers kernels, forced, in every precision, forward and backward.
  const regs = r.cases.filter((c) => c.kernel === 'registers');
  for (const p of ['f32', 'f16', 'bf16']) expect(regs.some((c) => c.precision === p), `no registers case in ${p}`);
  for (const c of regs) {
    expect(c.backward_kernel === 'registers', `registers case ran the backward on ${c.backward_kernel}`);
    expect(c.plan.text.includes('kernel: registers'), `registers case plan: ${c.plan.text}`);
  }
  for (const c of r.cases) {
    const name = `seqlen ${c.seqlen} d ${c.head_dim} heads ${c.heads} ${c.causal ? 'causal' : 'full'} ${c.precision}`;
    expect(c.passed === true, `${name}: the page says FAIL`);
    const want = ['o', 'lse', 'dq', 'dk', 'dv'];
    expect(c.checks.map((k) => k.name).join() === want.join(), `${name}: checks ${c.checks.map((k) => k.name)}, expected ${want}`);
    for (const k of c.checks) {
      // Re-apply the rule to the numbers rather than trusting the flag alone.
      expect(k.non_finite === null && finite(k.max_error) && finite(k.bound) && k.max_error <= k.bound,
        `${name}: ${k.name} error ${k.max_error} vs bound ${k.bound} (${k.non_finite})`);
    }
    expect(c.plan.m_bytes === m, `${name}: planned with M = ${c.plan.m_bytes}, the device granted ${m}`);
    expect(c.plan.br >= 1 && c.plan.bc >= 1 && c.plan.workgroup_bytes <= m, `${name}: plan Br ${c.plan.br} Bc ${c.plan.bc} ${c.plan.workgroup_bytes} B`);
    expect(c.plan.text.includes('Bc = ceil(M/4d)'), `${name}: plan text lacks the formula`);
    if (c.precision === 'f16' && !dev.shader_f16) expect(c.plan.storage === 'f16 (packed u32)', `${name}: storage ${c.plan.storage}`);
    if (c.precision === 'bf16') expect(c.plan.storage === 'bf16 (packed u32)', `${name}: storage ${c.plan.storage}`);
    expect(finite(c.kernel_ms) && c.kernel_ms > 0 && finite(c.gflops) && c.gflops > 0, `${name}: time ${c.kernel_ms} ms, ${c.gflops} GFLOP/s`);
    expect(finite(c.backward_kernel_ms) && c.backward_kernel_ms > 0 && finite(c.backward_gflops) && c.backward_gflops > 0,
      `${name}: backward time ${c.backward_kernel_ms} ms, ${c.backward_gflops} GFLOP/s`);
    expect(c.backward_plan.m_bytes === m && c.backward_plan.workgroup_bytes <= m, `${name}: backward planned with M = ${c.backward_plan.m_bytes}`);
  }

  // The layouts: each case forward and backward, every output under the rule.
  const layouts = r.layouts || [];
  for (const want of ['alibi', 'sinks', 'block-sparse', 'varlen', 'd512', 'dv', 'dropout']) {
    expect(layouts.some((c) => c.name === want), `no layout case ${want}`);
  }
  expect(layouts.some((c) => c.precision === 'bf16'), 'no bf16 layout case');
  for (const c of layouts) {
    const name = `layout ${c.name} ${c.precision}`;
    expect(c.passed === true, `${name}: the page says FAIL`);
    const want = ['o', 'lse', 'dq', 'dk', 'dv'];
    if (c.name === 'sinks' || c.name === 'varlen') want.push('dsinks');
    expect(c.checks.map((k) => k.name).join() === want.join(), `${name}: checks ${c.checks.map((k) => k.name)}, expected ${want}`);
    for (const k of c.checks) {
      expect(k.non_finite === null && finite(k.max_error) && finite(k.bound) && k.max_error <= k.bound,
        `${name}: ${k.name} error ${k.max_error} vs bound ${k.bound} (${k.non_finite})`);
    }
    // Dropout draws the CPU backend's mask for the same seed.
    if (c.name === 'dropout') expect(finite(c.cpu_o_diff) && c.cpu_o_diff < 1e-4, `${name}: |o - cpu o| ${c.cpu_o_diff}`);
    // A packed batch runs in one dispatch.
    if (c.name === 'varlen') expect(c.dispatches === 1, `${name}: ${c.dispatches} dispatches`);
  }

  // The decode panel: a paged cache on the device, steps by decode_async, one checked against the CPU backend.
  expect(Array.isArray(r.decode) && r.decode.length === 3, 'the decode panel did not run three times');
  expect(r.decode.some((c) => c.precision === 'bf16'), 'no bf16 decode run');
  for (const c of r.decode || []) {
    const name = `decode ${c.precision} cache ${c.cache_len} pages of ${c.page_size} splits ${c.requested_splits || 'planner'}`;
    expect(c.passed === true, `${name}: the page says FAIL`);
    const want = ['wgpu o', 'wgpu lse', 'cpu o', 'cpu lse'];
    expect(c.checks.map((k) => k.name).join() === want.join(), `${name}: checks ${c.checks.map((k) => k.name)}, expected ${want}`);
    for (const k of c.checks) {
      expect(k.non_finite === null && finite(k.max_error) && finite(k.bound) && k.max_error <= k.bound,
        `${name}: ${k.name} error ${k.max_error} vs bound ${k.bound} (${k.non_finite})`);
    }
    expect(c.cache_identical === true, `${name}: the device cache after the append differs from the CPU backend's`);
    expect(c.batch === 2 && c.start_lens[0] === c.cache_len, `${name}: sequences ${c.start_lens}`);
    expect(c.pages === c.batch * Math.ceil((c.cache_len + c.steps + 1) / c.page_size), `${name}: ${c.pages} pages`);
    expect(c.splits.length === c.steps && c.splits.every((n) => Number.isInteger(n) && n >= 1), `${name}: splits ${c.splits}`);
    if (c.requested_splits > 0) {
      // The loop limit may raise a requested count, never lower it.
      expect(c.splits.every((n) => n >= c.requested_splits), `${name}: asked ${c.requested_splits}, ran ${c.splits}`);
    } else {
      // WebGPU reports no core count, so the planner splits 1k keys over 4 workgroups (FlashDecoding).
      expect(c.splits.every((n) => n > 1), `${name}: the planner did not split: ${c.splits}`);
    }
    expect(c.plan.includes('splits:') && c.plan.includes('why:'), `${name}: plan text ${c.plan}`);
    if (c.precision === 'f16' && !dev.shader_f16) expect(c.plan.includes('packed'), `${name}: f16 not packed: ${c.plan}`);
    if (c.precision === 'bf16') expect(c.plan.includes('bf16 (packed u32)'), `${name}: bf16 storage: ${c.plan}`);
    expect(finite(c.step_ms) && c.step_ms > 0 && finite(c.token_ms) && c.token_ms > 0 && finite(c.tokens_per_s) && c.tokens_per_s > 0,
      `${name}: ${c.step_ms} ms a step, ${c.token_ms} ms a token`);
    expect(finite(c.kernel_ms) && c.kernel_ms > 0 && c.kernel_ms <= c.step_ms, `${name}: kernels ${c.kernel_ms} ms of ${c.step_ms}`);
    expect(finite(c.cpu_step_ms) && c.cpu_step_ms >= 0, `${name}: CPU step ${c.cpu_step_ms} ms`);
  }

  // The worked example: online softmax, whole-row softmax and the WGSL kernel all give 0.752.
  expect(r.worked.length === 3, 'worked example not run for Bc = 1, 2, 3');
  for (const w of r.worked) {
    expect(w.steps.length === Math.ceil(3 / w.block), `Bc ${w.block}: ${w.steps.length} steps`);
    expect(Math.abs(w.online_o - w.softmax_o) < 1e-12 && Math.abs(w.online_lse - w.softmax_lse) < 1e-12,
      `Bc ${w.block}: online ${w.online_o} vs softmax ${w.softmax_o}`);
    expect(w.softmax_o.toFixed(3) === '0.752', `softmax O ${w.softmax_o}`);
    expect(Math.abs(w.gpu_o - w.softmax_o) < 1e-4 && Math.abs(w.gpu_lse - w.softmax_lse) < 1e-4,
      `Bc ${w.block}: GPU O ${w.gpu_o} lse ${w.gpu_lse}, softmax ${w.softmax_o} ${w.softmax_lse}`);
  }

  // Heatmaps from the GPU's LSE: rows sum to 1, the causal one is zero above the diagonal.
  expect(r.heatmaps.length === 2, 'heatmaps missing');
  for (const h of r.heatmaps) {
    expect(h.max_row_sum_error < 1e-4, `heatmap rows sum to 1 within ${h.max_row_sum_error}`);
    if (h.causal) {
      let above = 0;
      for (let i = 0; i < h.seqlen; i++) for (let j = i + 1; j < h.seqlen; j++) above += h.p[i * h.seqlen + j];
      expect(above === 0, `causal heatmap has mass ${above} above the diagonal`);
    }
  }
  checkVerdicts(r);
}

// Wait until the page is done: fail when no check finished for STALL_S, or
// when the run takes longer than its number of checks times CHECK_S. Logs
// each finished check with its seconds.
async function waitForChecks(page) {
  const started = Date.now();
  let seen = 0;
  let lastChange = started;
  for (;;) {
    const s = await page.evaluate(() => {
      const r = window.flashattnResults;
      return r ? { done: r.done, progress: { ...r.progress } } : null;
    });
    const now = Date.now();
    const p = (s && s.progress) || { total: 0, finished: 0, last: null };
    if (p.finished > seen) {
      console.log(`  [${((now - started) / 1000).toFixed(0).padStart(4)} s] ${p.finished}/${p.total} ${p.last} ` +
        `(${((now - lastChange) / 1000).toFixed(1)} s)`);
      seen = p.finished;
      lastChange = now;
    }
    if (s && s.done) return;
    const at = p.last ? `after ${p.last}` : 'before the first check finished';
    if (now - lastChange > stallMs) {
      throw new Error(`no check finished for ${stallMs / 1000} s (STALL_S), ${p.finished}/${p.total} done, ${at}`);
    }
    if (p.total > 0 && now - started > p.total * perCheckMs) {
      throw new Error(`${p.total} checks took over ${p.total} x ${perCheckMs / 1000} s (CHECK_S), ${p.finished} done, ${at}`);
    }
    await new Promise((r) => setTimeout(r, 500));
  }
}

async function main() {
  const started = Date.now();
  if (!fs.existsSync(path.join(webDir, 'pkg', 'flashattn_web.js'))) {
    throw new Error('web/pkg is missing: run web/build.sh first');
  }
  const server = await serve();
  const url = `http://127.0.0.1:${server.address().port}/?selftest`;
  const browser = await chromium.launch({
    executablePath,
    headless: true,
    // WebGPU is behind --enable-unsafe-webgpu in headless Debian Chromium.
    args: ['--enable-unsafe-webgpu', '--no-sandbox', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync', '--disable-quic'],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1160, height: 900 }, deviceScaleFactor: 1 });
    const consoleErrors = [];
    page.on('console', (msg) => { if (msg.type() === 'error') consoleErrors.push(msg.text()); });
    page.on('pageerror', (e) => consoleErrors.push(String(e)));
    await page.goto(url);
    await waitForChecks(page);
    const r = await page.evaluate(() => window.flashattnResults);
    fs.mkdirSync(path.dirname(resultsPath), { recursive: true });
    fs.mkdirSync(path.dirname(screenshotPath), { recursive: true });
    fs.writeFileSync(resultsPath, JSON.stringify(r, null, 1));
    await page.screenshot({ path: screenshotPath, fullPage: true });

    checkResults(r);
    expect(consoleErrors.length === 0, `console errors: ${consoleErrors.join(' | ')}`);

    if (r.device) console.log(`adapter: ${[r.device.adapter, r.device.js_info?.vendor, r.device.js_info?.architecture].filter(Boolean).join(' ')}; workgroup storage granted ${r.device.granted.max_compute_workgroup_storage_size} B; shader-f16 ${r.device.shader_f16}`);
    for (const c of r.cases || []) {
      console.log(`  seqlen ${String(c.seqlen).padStart(3)} d ${String(c.head_dim).padStart(2)} heads ${c.heads} ${c.causal ? 'causal' : 'full  '} ${c.precision}: ` +
        `fwd Br ${c.plan.br} Bc ${c.plan.bc} ${c.kernel_ms.toFixed(1)} ms (${c.wall_ms.toFixed(1)} with transfers, ${c.gflops.toPrecision(3)} GFLOP/s), ` +
        `bwd ${c.backward_kernel_ms.toFixed(1)} ms (${c.backward_gflops.toPrecision(3)} GFLOP/s); ` +
        c.checks.map((k) => `${k.name} ${k.max_error.toExponential(1)}<=${k.bound.toExponential(1)}`).join(' ') + ` ${c.passed ? 'ok' : 'FAIL'}`);
    }
    for (const c of r.layouts || []) {
      console.log(`  layout ${c.name} ${c.precision}: ${c.dispatches} dispatch(es); ` +
        c.checks.map((k) => `${k.name} ${k.max_error.toExponential(1)}<=${k.bound.toExponential(1)}`).join(' ') + ` ${c.passed ? 'ok' : 'FAIL'}`);
    }
    for (const c of r.decode || []) {
      console.log(`  decode ${c.precision} cache ${c.cache_len} (pages of ${c.page_size}), ${c.requested_splits ? `${c.requested_splits} splits asked` : 'planner'}: ` +
        `splits ${[...new Set(c.splits)].join(',')}, ${c.step_ms.toFixed(2)} ms a step (${c.kernel_ms.toFixed(2)} in kernels), ` +
        `${c.token_ms.toFixed(2)} ms a token, CPU backend ${c.cpu_step_ms.toFixed(1)} ms a step; ` +
        c.checks.map((k) => `${k.name} ${k.max_error.toExponential(1)}<=${k.bound.toExponential(1)}`).join(' ') +
        `; cache ${c.cache_identical ? 'identical' : 'DIFFERS'} ${c.passed ? 'ok' : 'FAIL'}`);
    }
    for (const w of r.worked || []) console.log(`  worked example Bc ${w.block}: online ${w.online_o.toFixed(4)}, softmax ${w.softmax_o.toFixed(4)}, GPU ${w.gpu_o.toFixed(4)}`);
    console.log(`screenshot: ${path.relative(process.cwd(), screenshotPath)}; results: ${path.relative(process.cwd(), resultsPath)}; ${((Date.now() - started) / 1000).toFixed(1)} s`);
  } finally {
    await browser.close();
    server.close();
  }
  if (failures.length) {
    console.error(`browser test FAILED (${failures.length}):\n  - ${failures.join('\n  - ')}`);
    process.exit(1);
  }
  console.log('browser test passed');
}

main().catch((e) => {
  console.error(`browser test FAILED: ${e.message || e}`);
  process.exit(1);
});
