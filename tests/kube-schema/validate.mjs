// Checks Kubernetes objects against the API's schemas: the validators kubernetes-models
// generates from the Kubernetes OpenAPI document (types, required fields, formats such as
// quantities). Reads a JSON array of objects on stdin, each with apiVersion and kind, and
// prints one line per object: "ok KIND NAME" or "invalid KIND NAME: WHY". Exits 0 when all
// are valid, 1 when one is not, 2 when the input or a kind cannot be read.
//
//   npm ci --prefix tests/kube-schema
//   node tests/kube-schema/validate.mjs < objects.json
import { readFileSync } from "node:fs";

const objects = JSON.parse(readFileSync(0, "utf8"));
if (!Array.isArray(objects)) {
  console.error("validate: the input is not a JSON array of objects");
  process.exit(2);
}
let invalid = 0;
for (const object of objects) {
  const [group, version] = object.apiVersion.includes("/")
    ? object.apiVersion.split("/")
    : ["", object.apiVersion];
  const module = `kubernetes-models/${group ? `${group}/` : ""}${version}/${object.kind}`;
  let Model;
  try {
    Model = (await import(module))[object.kind];
  } catch (e) {
    console.error(`validate: no schema for ${object.apiVersion} ${object.kind}: ${e.message}`);
    process.exit(2);
  }
  const name = object.metadata?.name ?? "";
  try {
    new Model(object).validate();
    console.log(`ok ${object.kind} ${name}`);
  } catch (e) {
    invalid += 1;
    console.log(`invalid ${object.kind} ${name}: ${e.message}`);
  }
}
process.exit(invalid ? 1 : 0);
