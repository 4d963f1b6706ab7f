// The Vercel AI SDK's Open Responses provider against the proxy: a plain answer, a stream and a
// two-step tool loop. Prints one JSON object (what each scenario got) for tests/clients/test_ai_sdk.py.
//
//   PROXY_URL=http://127.0.0.1:8080 API_KEY=sk-... MODEL=tiny-org/tiny-model node run.mjs
import { createOpenResponses } from '@ai-sdk/open-responses';
import { generateText, streamText, stepCountIs, tool } from 'ai';
import { z } from 'zod';

const { PROXY_URL, API_KEY, MODEL } = process.env;
const MAX_OUTPUT_TOKENS = Number(process.env.MAX_OUTPUT_TOKENS || 256);
// Every response body is also kept as the bytes that came over the wire (the provider reads one
// branch of a tee), so the test sees how each stream ended.
const bodies = [];
async function recordingFetch(url, init) {
  const res = await fetch(url, init);
  if (!res.body) return res;
  const [mine, theirs] = res.body.tee();
  bodies.push(new Response(mine).text());
  return new Response(theirs, { status: res.status, statusText: res.statusText, headers: res.headers });
}
const provider = createOpenResponses({
  name: 'proxy', url: `${PROXY_URL}/v1/responses`, apiKey: API_KEY, fetch: recordingFetch,
});
const model = provider(MODEL);

const calls = [];
const tools = {
  get_weather: tool({
    description: 'Get the weather for a city',
    inputSchema: z.object({ city: z.string() }),
    execute: async ({ city }) => {
      calls.push(city);
      return `sunny, 21 C in ${city}`;
    },
  }),
};

function errorOf(e) {
  return { name: e?.name, message: String(e?.message ?? e), cause: String(e?.cause ?? '') };
}

async function plain() {
  const r = await generateText({ model, prompt: 'What is the capital of France?', maxOutputTokens: MAX_OUTPUT_TOKENS });
  return { text: r.text, finishReason: r.finishReason, usage: r.usage, modelId: r.response?.modelId };
}

async function stream() {
  const r = streamText({ model, prompt: 'Count to three.', maxOutputTokens: MAX_OUTPUT_TOKENS });
  const deltas = [];
  const errors = [];
  for await (const part of r.fullStream) {
    if (part.type === 'text-delta') deltas.push(part.text);
    if (part.type === 'error') errors.push(errorOf(part.error));
  }
  return { deltas, text: await r.text, finishReason: await r.finishReason, usage: await r.usage, errors };
}

async function toolLoop() {
  const r = await generateText({
    model,
    tools,
    prompt: 'What is the weather in Paris?',
    maxOutputTokens: MAX_OUTPUT_TOKENS,
    stopWhen: stepCountIs(2),
    // The first step must call the tool, the second must answer with the result: a model
    // too small to choose (the real-vLLM tier's) does both under these constraints.
    prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? 'required' : 'none' }),
  });
  return {
    steps: r.steps.map(s => ({
      finishReason: s.finishReason,
      toolCalls: s.toolCalls.map(c => ({ toolName: c.toolName, input: c.input })),
      toolResults: s.toolResults.map(t => ({ toolName: t.toolName, output: t.output })),
      text: s.text,
    })),
    text: r.text,
    executed: calls,
  };
}

const out = {};
for (const [name, run] of [['plain', plain], ['stream', stream], ['tools', toolLoop]]) {
  const first = bodies.length;
  try {
    out[name] = await run();
  } catch (e) {
    out[name] = { error: errorOf(e) };
  }
  out[name].wireTails = (await Promise.all(bodies.slice(first))).map(b => b.slice(-400));
}
process.stdout.write(JSON.stringify(out) + '\n');
