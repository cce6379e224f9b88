// llama.cpp, through node-llama-cpp's prebuilt CPU binaries, on one GGUF file: the ids it
// tokenizes a prompt into and its greedy completion (temperature 0, up to N tokens, ending at
// an end-of-generation token). One JSON line on stdout. Used by benchmarks/llama_cpp_check.py.
//
//   node generate.mjs MODEL.gguf PROMPT [N]
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

const [modelPath, prompt, limit] = [process.argv[2], process.argv[3], Number(process.argv[4] ?? 24)];
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: 512});
const sequence = context.getSequence();
const promptIds = model.tokenize(prompt, true);  // special tokens as written (the chat template's)
const completion = [];
for await (const token of sequence.evaluate(promptIds, {temperature: 0})) {
  if (model.isEogToken(token)) break;
  completion.push(token);
  if (completion.length >= limit) break;
}
console.log(JSON.stringify({prompt_ids: Array.from(promptIds), completion_ids: completion, text: model.detokenize(completion)}));
